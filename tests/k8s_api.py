"""A stand-in Kubernetes API server on loopback for the discovery tests: it answers the
EndpointSlice list and watch calls with the payload shapes in ``tests/data/k8s`` (written
from the API reference; no real cluster is used) and lets a test change the slices,
push watch events, end watches with an error, and fail requests."""

from __future__ import annotations

import copy
import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

DATA = Path(__file__).resolve().parent / "data" / "k8s"
PATH = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


def endpoint_slice(name: str, endpoints: list[tuple[str, bool | None]]) -> dict[str, Any]:
    """An EndpointSlice like the controller writes, with ``(address, ready)`` endpoints
    (``ready`` None: the condition left out, which the API says means ready)."""
    obj: dict[str, Any] = json.loads((DATA / "endpointslice.json").read_text())
    obj["metadata"]["name"] = name
    template = obj["endpoints"][0]
    obj["endpoints"] = []
    for i, (address, ready) in enumerate(endpoints):
        ep = copy.deepcopy(template)
        ep["addresses"] = [address]
        ep["targetRef"]["name"] = f"{name}-pod-{i}"
        if ready is None:
            del ep["conditions"]["ready"]
        else:
            ep["conditions"]["ready"] = ready
            ep["conditions"]["serving"] = ready
        obj["endpoints"].append(ep)
    return obj


class FakeKubeApi:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.lock = threading.Lock()
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 1000
        self.watches: list[queue.Queue[bytes | None]] = []
        self.requests: list[tuple[str, dict[str, list[str]], str]] = []  # path, query, auth
        self.fail_with: int | None = None  # answer every request with this status
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.end_watches()
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------- test controls

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def set_slice(self, obj: dict[str, Any], *, notify: bool = True) -> None:
        """Create or replace a slice; ``notify``: send ADDED/MODIFIED to open watches."""
        with self.lock:
            kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
            obj = self._bump(obj)
            self.slices[obj["metadata"]["name"]] = obj
            if notify:
                self._send({"type": kind, "object": obj})

    def delete_slice(self, name: str, *, notify: bool = True) -> None:
        with self.lock:
            obj = self._bump(self.slices.pop(name))
            if notify:
                self._send({"type": "DELETED", "object": obj})

    def expire_watches(self) -> None:
        """An ERROR event with a 410 Expired Status, then the watch ends (as the API
        server does when the client's resourceVersion is too old)."""
        status = json.loads((DATA / "status_expired.json").read_text())
        with self.lock:
            self._send({"type": "ERROR", "object": status})
        self.end_watches()

    def end_watches(self) -> None:
        with self.lock:
            for q in self.watches:
                q.put(None)
            self.watches = []

    def lists(self) -> int:
        return sum(1 for _, q, _ in self.requests if "watch" not in q)

    def watch_count(self) -> int:
        return sum(1 for _, q, _ in self.requests if "watch" in q)

    def _send(self, event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        for q in self.watches:
            q.put(line)

    # ------------------------------------------------------------- HTTP

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                api.requests.append((parts.path, query, self.headers.get("Authorization", "")))
                if api.fail_with is not None:
                    self._json(api.fail_with, {"kind": "Status", "code": api.fail_with})
                    return
                if parts.path != PATH.format(ns=api.namespace):
                    self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return
                want = dict(
                    kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv
                )
                if "watch" in query:
                    self._watch(want)
                    return
                with api.lock:
                    body = json.loads((DATA / "endpointslicelist.json").read_text())
                    body["metadata"]["resourceVersion"] = str(api.version)
                    for obj in api.slices.values():
                        if _matches(obj, want):
                            item = copy.deepcopy(obj)
                            del item["apiVersion"], item["kind"]  # list items carry neither
                            body["items"].append(item)
                self._json(200, body)

            def _watch(self, want: dict[str, str]) -> None:
                q: queue.Queue[bytes | None] = queue.Queue()
                with api.lock:
                    api.watches.append(q)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while True:
                        try:
                            line = q.get(timeout=60)
                        except queue.Empty:
                            break
                        if line is None:
                            break
                        event = json.loads(line)
                        if event["type"] != "ERROR" and not _matches(event["object"], want):
                            continue
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass
                self.close_connection = True

        return Handler


def _matches(obj: dict[str, Any], want: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in want.items())
