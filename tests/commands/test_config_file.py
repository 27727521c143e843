"""``kvroute serve --config FILE`` and ``KVROUTE_*``: every flag has a file key and a
variable, precedence flag > env > file > default, bad input refused at start-up (exit 2)
with the file, key and reason, ``--print-config`` masks secrets."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.commands import serve
from kvroute.commands.config_file import options


def effective(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object], str]:
    """Exit code, the printed settings (parsed back as TOML) and stderr."""
    code = main(["serve", *argv, "--print-config"])
    out, err = capsys.readouterr()
    return code, (tomllib.loads(out) if code == 0 else {}), err


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("KVROUTE_"):
            monkeypatch.delenv(k)


def test_precedence_is_flag_then_env_then_file_then_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "kvroute.toml"
    cfg.write_text('port = 31000\npolicy = "round_robin"\ncache_threshold = 0.5\n')
    _, s, _ = effective(capsys)
    assert s["port"] == 30000 and s["policy"] == "cache_aware"
    _, s, _ = effective(capsys, "--config", str(cfg))
    assert (s["port"], s["policy"], s["cache-threshold"]) == (31000, "round_robin", 0.5)
    monkeypatch.setenv("KVROUTE_PORT", "31001")
    monkeypatch.setenv("KVROUTE_WORKER_URLS", "http://127.0.0.1:1, http://127.0.0.1:2")
    _, s, _ = effective(capsys, "--config", str(cfg))
    assert s["port"] == 31001 and s["policy"] == "round_robin"
    assert s["worker-urls"] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    # A flag wins even when it restates the default.
    _, s, _ = effective(capsys, "--config", str(cfg), "--port", "30000")
    assert s["port"] == 30000
    # The file can be named by the environment too.
    monkeypatch.setenv("KVROUTE_CONFIG", str(cfg))
    _, s, _ = effective(capsys)
    assert s["policy"] == "round_robin"


def test_printed_config_is_a_config_file_with_every_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, printed, _ = effective(
        capsys, "--policy", "prefix_hash", "--worker-urls", "http://127.0.0.1:9"
    )
    assert code == 0
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    dests = {d.replace("_", "-") for d in options(parser)}
    # Unset (None) settings are printed commented out; every other one is a key.
    unset = {d for d in dests if d not in printed}
    assert all(parser.get_default(d.replace("-", "_")) is None for d in unset), unset
    cfg = tmp_path / "printed.toml"
    cfg.write_text(_dump(printed))
    _, again, _ = effective(capsys, "--config", str(cfg))
    assert again == printed


def _dump(values: dict[str, object]) -> str:
    import json

    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())


def test_secrets_are_masked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text("api-key: s3cret-client-key\nworker_api_key: s3cret-worker-key\n")
    code = main(
        ["serve", "--config", str(cfg), "--admin-api-key", "s3cret-admin", "--print-config"]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    assert "s3cret" not in out
    assert tomllib.loads(out)["api-key"] == "***"
    assert tomllib.loads(out)["admin-api-key"] == "***"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("prot = 1\n", "key 'prot': unknown setting"),
        ('port = "x"\n', "key 'port': expected an integer, got 'x'"),
        ("port = true\n", "key 'port': expected an integer, got a boolean"),
        ('policy = "fastest"\n', "key 'policy': 'fastest' is not one of"),
        ("worker-urls = [1]\n", "key 'worker-urls': expected a string"),
        ("port = 70000\n", "--port must be in 1..65535, got 70000 (--port set by file"),
        ("port = \n", "not valid TOML"),
    ],
)
def test_bad_file_is_refused_with_file_key_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, reason: str
) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    code, _, err = effective(capsys, "--config", str(cfg))
    assert code == 2
    assert str(cfg) in err
    assert reason in err


def test_bad_environment_value_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVROUTE_MAX_RETRIES", "many")
    code, _, err = effective(capsys)
    assert code == 2
    assert "environment variable KVROUTE_MAX_RETRIES: expected an integer" in err


def test_discovery_settings_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = effective(capsys, "--service-discovery", "dns", "--dns-name", "vllm")
    assert code == 2 and "needs --worker-port" in err
    code, _, err = effective(capsys, "--service-discovery", "k8s", "--worker-port", "8000")
    assert code == 2 and "needs --selector" in err
    code, _, _ = effective(
        capsys, "--service-discovery", "dns", "--dns-name", "_http._tcp.vllm.svc"
    )
    assert code == 0  # SRV records carry the port
