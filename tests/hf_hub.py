"""A stand-in Hugging Face Hub on loopback for the ``--tokenizer MODEL_ID`` tests: it
answers the calls ``huggingface_hub.snapshot_download`` makes (a revision's commit and
file list, ``GET /api/models/{repo}/revision/{rev}``, its tree, ``GET
/api/models/{repo}/tree/{sha}``, and each file, ``HEAD``/``GET
/{repo}/resolve/{rev}/{file}``) with the shapes the Hub answers (written from
huggingface_hub's client code; no real Hub is reached), and records every path asked
for, so a test can check what was downloaded and what was not."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class StandInHub:
    """One repository ``repo`` at commit ``sha`` holding ``files`` (name -> bytes)."""

    def __init__(self, repo: str, sha: str, files: dict[str, bytes]) -> None:
        self.repo = repo
        self.sha = sha
        self.files = files
        self.requests: list[tuple[str, str]] = []  # (method, path)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path))
                info = f"/api/models/{hub.repo}/revision/"
                tree = f"/api/models/{hub.repo}/tree/"
                resolve = f"/{hub.repo}/resolve/"
                if path.startswith(tree) and path[len(tree) :] in ("main", hub.sha):
                    entries = [
                        {
                            "type": "file",
                            "oid": hashlib.sha1(data).hexdigest(),
                            "size": len(data),
                            "path": name,
                        }
                        for name, data in sorted(hub.files.items())
                    ]
                    self._send(200, json.dumps(entries).encode(), "application/json", body)
                    return
                if path.startswith(info) and path[len(info) :] in ("main", hub.sha):
                    siblings = [{"rfilename": name} for name in sorted(hub.files)]
                    data = json.dumps(
                        {"id": hub.repo, "sha": hub.sha, "siblings": siblings}
                    ).encode()
                    self._send(200, data, "application/json", body)
                    return
                if path.startswith(resolve):
                    rev, _, name = path[len(resolve) :].partition("/")
                    if rev in ("main", hub.sha) and name in hub.files:
                        data = hub.files[name]
                        self._send(200, data, "application/octet-stream", body, file=True)
                        return
                payload = json.dumps({"error": "Repository not found"}).encode()
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def _send(
                self, status: int, data: bytes, kind: str, body: bool, file: bool = False
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                if file:
                    self.send_header("X-Repo-Commit", hub.sha)
                    self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fetched(self) -> set[str]:
        """The files whose content was asked for (GET)."""
        prefix = f"/{self.repo}/resolve/"
        return {
            p[len(prefix) :].partition("/")[2]
            for m, p in self.requests
            if m == "GET" and p.startswith(prefix)
        }

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def repository_files(tokenizer_dir: str) -> dict[str, bytes]:
    """A model repository's files: the tokenizer's from ``tokenizer_dir``, a config and
    weights (which a tokenizer download must leave alone)."""
    files = {p.name: p.read_bytes() for p in Path(tokenizer_dir).iterdir() if p.is_file()}
    files["config.json"] = json.dumps({"model_type": "qwen3"}).encode()
    files["model-00001-of-00002.safetensors"] = b"\0" * 4096
    files["README.md"] = b"# a model\n"
    return files
