"""Chat templates rendered in a bounded sandbox, off the event loop.

A chat template is Jinja code. The model's own template comes from the tokenizer
directory the operator chose; a request may carry another (``chat_template``, top level
or inside ``chat_template_kwargs``), which is code written by the client. Both are
rendered here, never through ``tokenizer.apply_chat_template``:

* The environment is ``jinja2.sandbox.ImmutableSandboxedEnvironment`` set up as
  transformers sets it up (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its
  ``tojson``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``), and the
  template sees what transformers passes (the messages with ``None`` fields dropped and
  reasoning aliased, ``tools``, ``documents``, ``add_generation_prompt``, the special
  tokens, the kwargs), so the text is the one the engine renders (tested on Qwen3).
* Every render has a budget (``Bounds``): a number of steps, a wall-clock deadline and
  a size. A step is counted at every loop iteration (the compiled template's ``for``
  loops are wrapped), call, attribute or item read, filter and intercepted operator;
  the deadline is checked every 256 steps. Any string, list or dict that flows through
  those points, and the output itself, must stay under the size bound, and the
  operators that build big values (``*``, ``**``, ``+``, ``%``) and the filters that
  take a width are checked before they allocate. Over any bound the render stops with
  ``TemplateBoundsError``, which the router answers with 400.
* The render runs in a small thread pool, so a slow template never blocks the event
  loop: ``/health`` and other requests go on while it runs.

Request kwargs: by default only ``ALLOWED_KWARGS`` (scalar values) may be set through
``chat_template_kwargs`` and a request ``chat_template`` is refused, as vLLM refuses it
without ``--trust-request-chat-template``; with that flag any kwarg and template are
accepted (still sandboxed and bounded).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvroute.errors import BadRequestError

# Kwargs a client may pass through ``chat_template_kwargs`` without
# --trust-request-chat-template: switches the shipped templates read (Qwen3's
# ``enable_thinking``, DeepSeek's ``thinking``, gpt-oss's ``reasoning_effort``).
ALLOWED_KWARGS = ("enable_thinking", "thinking", "reasoning_effort")
# Request fields that replace the template itself.
TEMPLATE_FIELDS = ("chat_template",)

# Size bound: the rendered text (and any value inside the render) may be this many
# times the request body, plus a floor for the template's own text.
SIZE_PER_BODY_BYTE = 4
SIZE_FLOOR = 64 * 1024
# Step bound: loop iterations, calls and reads per request body byte, plus a floor.
STEPS_PER_BODY_BYTE = 64
STEPS_FLOOR = 200_000
MAX_TEMPLATE_CHARS = 64 * 1024  # a request's own template (models' are ~4-10 KB)
_CLOCK_EVERY = 256  # steps between deadline checks (time.monotonic costs ~50 ns)

_LOOP = re.compile(r"^(\s*)((?:async )?for .+? in )(.+):$", re.MULTILINE)
# Widths and precisions in format specs: '%-10.3s' and '{:>10}' / '{0:{1}}'.
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:[^{}\d]*(\d*)(?:\.(\d+))?")


class TemplateBoundsError(BadRequestError):
    """A template render went over its step, time or size bound."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="chat_template_too_expensive")


@dataclass
class Bounds:
    """One render's budget."""

    max_chars: int
    max_steps: int
    deadline: float
    steps: int = field(default=0)

    @classmethod
    def for_body(cls, body_bytes: int, timeout_s: float) -> Bounds:
        return cls(
            max_chars=SIZE_FLOOR + SIZE_PER_BODY_BYTE * body_bytes,
            max_steps=STEPS_FLOOR + STEPS_PER_BODY_BYTE * body_bytes,
            deadline=time.monotonic() + timeout_s,
        )

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise TemplateBoundsError(
                f"the chat template took more than {self.max_steps:,} steps to render"
            )
        if self.steps % _CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
            raise TemplateBoundsError("the chat template took too long to render")

    def size(self, value: Any) -> Any:
        # str.__len__, not len(): a Tracked string (template_cache's probe) records
        # len() as a question the template asked of the content.
        n = str.__len__(value) if isinstance(value, str) else None
        if n is None and isinstance(value, list | tuple | dict):
            n = len(value)
        if n is not None and n > self.max_chars:
            raise TemplateBoundsError(
                f"the chat template built a value over {self.max_chars:,} items"
            )
        return value

    def room(self, n: int) -> None:
        """Refuse to build a value of ``n`` items before building it."""
        if n > self.max_chars:
            raise TemplateBoundsError(
                f"the chat template would build a value of {n:,} items (bound {self.max_chars:,})"
            )


class Tracked(str):
    """A string the cache of rendered templates follows through a render
    (``kvroute.routing.template_cache.Probe``). The environment hands it the operators
    and filters it is used with; in a plain render there is none."""

    def binop(self, operator: str, left: Any, right: Any) -> Any:
        raise NotImplementedError

    def used_by(self, name: str) -> None:
        """``name`` (a filter or test) was applied to this string."""


_BOUNDS: contextvars.ContextVar[Bounds] = contextvars.ContextVar("kvroute_template_bounds")


def _bounds() -> Bounds:
    return _BOUNDS.get()


def _ticking(items: Iterable[Any]) -> Iterator[Any]:
    b = _bounds()
    for item in items:
        b.step()
        yield item


def _check_format(fmt: Any, brace: bool = True) -> None:
    """Refuse a format string whose width or precision is over the size bound."""
    if not isinstance(fmt, str):
        return
    limit = _bounds().max_chars
    for spec in (_BRACE_SPEC if brace else _PERCENT_SPEC).findall(fmt):
        if any(n and int(n) > limit for n in spec):
            raise TemplateBoundsError("the chat template asked for a format width over the bound")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every step counted and every value's size checked."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def _compile(self, source: str, filename: str) -> Any:
        # Every loop of the compiled template iterates through _ticking, so a loop with
        # an empty body still counts its iterations.
        source = _LOOP.sub(r"\1\2environment.ticking(\3):", source)
        return super()._compile(source, filename)

    @staticmethod
    def ticking(items: Iterable[Any]) -> Iterator[Any]:
        return _ticking(items)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _bounds()
        b.step()
        if isinstance(left, Tracked) or isinstance(right, Tracked):
            tracked = left if isinstance(left, Tracked) else right
            return b.size(tracked.binop(operator, left, right))
        seqs = (str, list, tuple)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, seqs) and isinstance(n, int):
                    b.room(len(seq) * max(n, 0))
        elif operator == "+" and isinstance(left, seqs) and isinstance(right, seqs):
            b.room(len(left) + len(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and left.bit_length() * right > 64 * 1024:
                raise TemplateBoundsError("the chat template computes too large a number")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, brace=False)
        return b.size(super().call_binop(context, operator, left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        b = _bounds()
        b.step()
        return b.size(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        b = _bounds()
        b.step()
        return b.size(super().getitem(obj, argument))

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        b = _bounds()
        b.step()
        # The sandbox hands str.format out wrapped; the string is the wrapped one's self.
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and a > b.max_chars:
                if isinstance(owner, str):  # widths: center, ljust, zfill, ...
                    raise TemplateBoundsError("the chat template asked for a width over the bound")
            b.size(a)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in ("format", "format_map"):
            _check_format(owner)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, range):
            return _ticking(result) if len(result) > 64 else result
        return b.size(result)


def _bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        b = _bounds()
        b.step()
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tracked):
                a.used_by(f.__name__)
            elif isinstance(a, int) and not isinstance(a, bool) and a > b.max_chars:
                raise TemplateBoundsError("a filter was passed a number over the bound")
        strings = [a for a in args if isinstance(a, str)]
        if f.__name__ == "do_replace" and len(strings) >= 3:
            s, old, new = strings[:3]
            b.room(len(s) + (s.count(old) if old else len(s) + 1) * max(0, len(new) - len(old)))
        if f.__name__ == "do_format" and strings:
            _check_format(strings[0], brace=False)
        return b.size(f(*args, **kwargs))

    return run


def _watched_test(name: str, test: Callable[..., Any]) -> Callable[..., Any]:
    """A test (``is lower``, ``is in``...) that tells a Tracked argument it was used."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        for a in args:
            if isinstance(a, Tracked):
                a.used_by("test:" + name)
        return test(*args, **kwargs)

    return run


class _Generation(jinja2.ext.Extension):
    """``{% generation %}`` (assistant-mask markers in some templates): renders its
    body unchanged, as transformers does when no mask is asked for."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads it as a class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        _bounds().size(value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError("no underscore-prefixed namespace attributes")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, json.dumps' options.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    _bounds().room(len(fmt) * 64)  # no directive expands past ~64 characters
    return datetime.now().strftime(fmt)


def make_environment() -> BoundedEnvironment:
    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.tests = {name: _watched_test(name, t) for name, t in env.tests.items()}  # type: ignore[arg-type]
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


_ENV = make_environment()
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def compile_template(source: str) -> jinja2.Template:
    """Compile ``source``; raises jinja2.TemplateSyntaxError (the caller says whose)."""
    return _ENV.from_string(source)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to the template: ``None`` fields dropped,
    reasoning under ``reasoning_content`` and ``thinking`` too."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def request_template_kwargs(
    body: dict[str, Any], *, trusted: bool
) -> tuple[str | None, dict[str, Any]]:
    """(the request's own template or None, kwargs for the template) from a chat body.
    Raises BadRequestError for what an untrusted request may not set."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise BadRequestError("'chat_template_kwargs' must be an object")
    template = body.get("chat_template", kwargs.get("chat_template"))
    kwargs = {k: v for k, v in kwargs.items() if k not in TEMPLATE_FIELDS}
    if not trusted:
        if template is not None:
            raise BadRequestError(
                "request-supplied chat templates are refused: the router renders the "
                "model's own template (the operator may allow them with "
                "--trust-request-chat-template)",
                code="chat_template_not_allowed",
            )
        for k, v in kwargs.items():
            if k not in ALLOWED_KWARGS:
                raise BadRequestError(
                    f"chat_template_kwargs: {k!r} is not allowed (allowed: "
                    f"{', '.join(ALLOWED_KWARGS)}; the operator may allow any with "
                    "--trust-request-chat-template)",
                    code="chat_template_not_allowed",
                )
            if v is not None and not isinstance(v, bool | int | float | str):
                raise BadRequestError(f"chat_template_kwargs: {k!r} must be a scalar")
    if template is not None and not isinstance(template, str):
        raise BadRequestError("'chat_template' must be a string")
    if template is not None and len(template) > MAX_TEMPLATE_CHARS:
        # Compiling is not step-counted: the template's own size bounds it.
        raise TemplateBoundsError(f"'chat_template' is over {MAX_TEMPLATE_CHARS:,} characters")
    return template, kwargs


def render(template: jinja2.Template, variables: dict[str, Any], bounds: Bounds) -> str:
    """Render ``template`` within ``bounds`` (synchronous; call it off the loop)."""
    token = _BOUNDS.set(bounds)
    try:
        out: list[str] = []
        total = 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > bounds.max_chars:
                raise TemplateBoundsError(
                    f"the rendered prompt is over {bounds.max_chars:,} characters"
                )
            out.append(chunk)
            bounds.step()
        return "".join(out)
    finally:
        _BOUNDS.reset(token)


_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvroute-template")


async def render_off_loop(call: Callable[[], str], timeout_s: float) -> str:
    """Run ``call`` (a render) in the template pool; past ``timeout_s`` (plus a little,
    the render checks its own deadline) the request gets its 400 regardless."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    future = loop.run_in_executor(_POOL, ctx.run, call)
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s + 0.5)
    except TimeoutError:
        raise TemplateBoundsError("the chat template took too long to render") from None
