"""HTTPS on the router's own listener (``--ssl-certfile``), and client certificates
(``--ssl-ca-certs``): a real ``kvroute serve`` with certificates from a throwaway CA
made with ``openssl``, in front of a fake worker; and that router as an ``https://``
worker of another."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from support import certificates, start_fake_worker

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

BODY = {"model": "fake-model", "prompt": "hello over TLS", "max_tokens": 1}


def https_router(tmp_path: Path, worker: Server, *flags: str, verify: ssl.SSLContext) -> Server:
    port = free_port()
    argv = kvroute_argv("serve", "--port", str(port), "--worker-urls", worker.url, *flags)
    name = f"router-{port}"
    return start_server(name, argv, port, log_dir=str(tmp_path), scheme="https", verify=verify)


def test_the_router_serves_https_and_checks_client_certificates(
    tmp_path: Path, processes: list[Server]
) -> None:
    ca_file = str(certificates(tmp_path, "router", "client"))
    ca = ssl.create_default_context(cafile=ca_file)
    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    tls = ("--ssl-certfile", str(tmp_path / "router.crt"))
    tls += ("--ssl-keyfile", str(tmp_path / "router.key"))
    router = https_router(tmp_path, worker, *tls, verify=ca)
    processes.append(router)
    assert router.url.startswith("https://")
    r = httpx.post(router.url + "/v1/completions", json=BODY, verify=ca, timeout=30)
    assert r.status_code == 200, r.text
    plain = router.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.post(plain + "/v1/completions", json=BODY, timeout=10)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust its CA
        httpx.get(router.url + "/health", timeout=10)
    assert "kvroute on https://" in router.log_tail(10_000)

    # The router as an https:// worker of another router, which trusts the CA through
    # SSL_CERT_FILE: health checks and requests go over TLS.
    port = free_port()
    front = start_server(
        f"front-{port}",
        kvroute_argv("serve", "--port", str(port), "--worker-urls", router.url),
        port,
        log_dir=str(tmp_path),
        env={"SSL_CERT_FILE": ca_file},
    )
    processes.append(front)
    r = httpx.post(front.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-worker"] == router.url

    # Mutual TLS: a client without a certificate signed by the CA is turned away.
    client = ssl.create_default_context(cafile=ca_file)
    client.load_cert_chain(str(tmp_path / "client.crt"), str(tmp_path / "client.key"))
    mutual = https_router(tmp_path, worker, *tls, "--ssl-ca-certs", ca_file, verify=client)
    processes.append(mutual)
    with pytest.raises(httpx.HTTPError):
        httpx.post(mutual.url + "/v1/completions", json=BODY, verify=ca, timeout=10)
    r = httpx.post(mutual.url + "/v1/completions", json=BODY, verify=client, timeout=30)
    assert r.status_code == 200, r.text


def test_bad_tls_settings_are_one_line_and_exit_2(tmp_path: Path) -> None:
    certificates(tmp_path, "one", "two")
    cert, other_key = str(tmp_path / "one.crt"), str(tmp_path / "two.key")
    cases = {
        ("--ssl-certfile", cert, "--ssl-keyfile", other_key): "cannot load the certificate",
        ("--ssl-certfile", str(tmp_path / "missing.crt")): "no such file",
        ("--ssl-keyfile", other_key): "need --ssl-certfile",
        (
            "--ssl-certfile",
            cert,
            "--ssl-keyfile",
            str(tmp_path / "one.key"),
            "--ssl-ca-certs",
            str(tmp_path / "one.key"),
        ): "not a CA bundle",
    }
    for flags, said in cases.items():
        out = subprocess.run(
            [*kvroute_argv("serve", "--worker-urls", "http://127.0.0.1:9"), *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, (flags, out.stderr)
        assert said in out.stderr and "Traceback" not in out.stderr, (flags, out.stderr)
