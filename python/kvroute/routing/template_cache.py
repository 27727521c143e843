"""The model's own chat template, rendered once per conversation *shape*.

Rendering the template (Jinja in the sandbox of ``kvroute.routing.templates``, in its
thread pool) is about half of the router's tokenization CPU per chat request, yet what
the template does with a conversation depends on its structure far more than on its
texts. A *shape* is a request with every message's text left out: the roles and other
fields of the messages, the kwargs and tools. This cache renders a shape once with a
**probe** in place of each message's text and produces later renders of the same shape
by putting the real texts where the probes' random markers are, on the event loop,
without the pool. (A message whose content is not a string stays in the shape.)

Why that is the full render's text. A probe is a ``str`` whose text is its marker;
during the render it sees every use the template makes of it:

* questions with a plain answer (``startswith``, ``endswith``, ``in``, ``==``, ``len``,
  truth, ``is string``, ...) are recorded with their answers; ``strip``/``trim`` are
  recorded as "leaves it unchanged" and return the probe;
* ``+`` with the probe (the sandbox intercepts it) gives a new tracked string, whose own
  questions are recorded with its text (re-asked later with the real text put in);
* anything else (slicing, ``split``, ``replace``, iteration, hashing, ``%``, format,
  ``tojson`` and the other filters and tests) marks the shape uncacheable.

Output is ``str()`` of a tracked string, a verbatim copy. A cached render is used only
when the real texts give every recorded answer, so the template takes the same branches
and its output differs only where the texts are copied in. Uses of the text the sandbox
cannot see are kept out by refusing, at load, templates with ``~`` or block ``set``,
macros, call and filter blocks (they join strings without ``+``), ``x in 'literal'``, the
clock (``strftime_now``) or randomness (``random``, ``lipsum``). On top of that a shape
is accepted only after two checks with the real renderer: the render of the markers as
plain texts equals the probes', and the render of awkward texts (quotes, backslashes,
newlines, markup, accents, CJK, emoji) equals the cached render with them put in.

A shape is learned the second time it is seen (one-off shapes cost no learning
renders). Bounds: ``size`` shapes and
``max_bytes`` (estimated) in an LRU; the render's own step bound is compared with the
steps the learning render took, and the output's size with the request's size bound
(otherwise: a full render, which answers the bound error). Only the model's own template
goes through here; a request's own template (``--trust-request-chat-template``) is
always rendered in full.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2.nodes
import orjson

from kvroute.routing.templates import Bounds, Tracked, make_environment

# (messages, kwargs, tools, bounds) -> the rendered text, through the sandbox.
Render = Callable[[list[dict[str, Any]], dict[str, Any], Any, Bounds], str]

ASKED = frozenset(
    "startswith endswith find rfind index rindex count isspace isalpha isdigit isalnum "
    "isupper islower istitle isnumeric isdecimal isidentifier isprintable isascii".split()
)
STRIPS = frozenset(("strip", "lstrip", "rstrip"))
# Filters and tests that only ask a recorded question of the text or pass it through.
FILTERS_OK = frozenset(("len", "do_trim", "soft_str", "do_default"))
TESTS_OK = frozenset(
    "test:" + t
    for t in "defined undefined none string mapping number integer float boolean true false "
    "callable eq ne equalto".split()
)
AWKWARD = "\"q\" 'a' \\ \n\t\r\n <b>&amp;</b> {{x}} {% y %} Mixed é 中 🙂"
# Template nodes through which the text could be used without the sandbox seeing it.
_REFUSED_NODES = (
    jinja2.nodes.Concat,
    jinja2.nodes.AssignBlock,
    jinja2.nodes.Macro,
    jinja2.nodes.CallBlock,
    jinja2.nodes.FilterBlock,
    jinja2.nodes.Include,
    jinja2.nodes.Import,
    jinja2.nodes.FromImport,
    jinja2.nodes.Extends,
)
_REFUSED_NAMES = frozenset(("strftime_now", "lipsum"))


def why_not_cacheable(source: str) -> str | None:
    """Why renders of ``source`` cannot be cached, or None when they can."""
    try:
        ast = make_environment().parse(source)
    except jinja2.TemplateSyntaxError as e:
        return f"template does not parse: {e}"
    for node in ast.find_all(_REFUSED_NODES):
        return f"template uses {type(node).__name__}"
    for name in ast.find_all(jinja2.nodes.Name):
        if name.name in _REFUSED_NAMES:
            return f"template calls {name.name}"
    for f in ast.find_all(jinja2.nodes.Filter):
        if f.name == "random":
            return "template uses the random filter"
    for op in ast.find_all(jinja2.nodes.Operand):
        if op.op in ("in", "notin") and isinstance(op.expr, jinja2.nodes.Const):
            return "template tests 'x in <literal>'"
    return None


class _Record:
    """What one learning render saw: questions (text, name, args, answer), tracked
    texts built, and why the shape cannot be cached (None: it can)."""

    def __init__(self) -> None:
        self.questions: list[tuple[str, str, tuple[Any, ...], Any]] = []
        self.derived: set[str] = set()
        self.tainted: str | None = None

    def taint(self, why: str) -> None:
        if self.tainted is None:
            self.tainted = why


_OWN = frozenset(("_rec", "__class__", "__dict__", "binop", "used_by", "_ask", "_strip", "_taint"))


class Probe(Tracked):
    """A tracked string (see the module docstring)."""

    _rec: _Record

    def __new__(cls, text: str, rec: _Record) -> Probe:
        obj = super().__new__(cls, text)
        object.__setattr__(obj, "_rec", rec)
        return obj

    def __getattribute__(self, name: str) -> Any:
        if name in _OWN:
            return object.__getattribute__(self, name)
        attr = super().__getattribute__(name)
        if name in ASKED:
            return lambda *args: self._ask(name, *args)
        if name in STRIPS:
            return lambda *args: self._strip(name, *args)
        if not name.startswith("_"):
            self._taint(f"method {name}")
        return attr

    def _ask(self, name: str, *args: Any) -> Any:
        answer = getattr(str, name)(str(self), *args)
        self._rec.questions.append((str(self), name, args, answer))
        return answer

    def _strip(self, name: str, *args: Any) -> Any:
        text = str(self)
        if getattr(str, name)(text, *args) != text:
            self._taint(f"{name} changes the text")
        self._rec.questions.append((text, name, args, text))
        return self

    def _taint(self, why: str) -> None:
        self._rec.taint(why)

    def binop(self, operator: str, left: Any, right: Any) -> Any:
        plain = [str(x) if isinstance(x, Tracked) else x for x in (left, right)]
        if operator != "+" or not all(isinstance(x, str) for x in plain):
            self._taint(f"operator {operator}")
            return {"*": str.__mul__, "%": str.__mod__}.get(operator, str.__add__)(*plain)
        out = Probe(plain[0] + plain[1], self._rec)
        self._rec.derived.add(str(out))
        return out

    def used_by(self, name: str) -> None:
        if name not in FILTERS_OK and name not in TESTS_OK:
            self._taint(f"filter or test {name}")

    def __contains__(self, other: object) -> bool:
        return bool(self._ask("__contains__", other))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, str):
            return False  # whatever the text
        return bool(self._ask("__eq__", str(other)))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __len__(self) -> int:
        return int(self._ask("__len__"))

    def __bool__(self) -> bool:
        text = str(self)
        self._rec.questions.append((text, "__bool__", (), bool(text)))
        return bool(text)

    def __hash__(self) -> int:
        self._taint("hashed")
        return str.__hash__(self)

    def __getitem__(self, key: Any) -> str:
        self._taint("indexed")
        return str.__getitem__(self, key)

    def __iter__(self) -> Any:
        self._taint("iterated")
        return str.__iter__(self)

    def __add__(self, other: Any) -> Any:
        return self.binop("+", self, other)

    def __radd__(self, other: Any) -> Any:
        return self.binop("+", other, self)

    def __mul__(self, n: Any) -> str:
        self._taint("repeated")
        return str.__mul__(self, n)

    __rmul__ = __mul__

    def __mod__(self, other: Any) -> str:
        self._taint("formatted")
        return str.__mod__(self, other)

    def __rmod__(self, other: Any) -> Any:
        self._taint("formatted")
        return NotImplemented

    def __format__(self, spec: str) -> str:
        self._taint("formatted")
        return str.__format__(self, spec)

    def __lt__(self, other: Any) -> bool:
        self._taint("compared")
        return str.__lt__(self, other)

    __le__ = __gt__ = __ge__ = __lt__

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._taint("copied")
        return (str, (str(self),))


Question = tuple[str, str, tuple[Any, ...], Any]


def _fill(text: str, fills: dict[str, str]) -> str:
    """``text`` with each marker replaced by its message's text."""
    if text in fills:  # the common case: a question asked of the text itself
        return fills[text]
    for marker, content in fills.items():
        if marker in text:
            text = text.replace(marker, content)
    return text


def _holds(fills: dict[str, str], questions: list[Question]) -> bool:
    for text, name, args, answer in questions:
        real = _fill(text, fills)
        if name == "__bool__":
            if bool(real) != answer:
                return False
        elif name in STRIPS:
            if getattr(str, name)(real, *args) != real:
                return False
        elif getattr(str, name)(real, *args) != answer:
            return False
    return True


@dataclass(slots=True)
class Shape:
    text: str  # the render with each probed message's text as its marker
    questions: list[Question]
    steps: int  # the learning render's steps (the same for any texts giving the answers)
    sizes: list[tuple[int, list[int]]]  # (length, copies of each marker): tracked strings
    cost: int  # bytes, estimated
    # ``text`` cut at the markers (each marker a part of its own): a render is one join.
    parts: list[str]
    # The longest tracked string and each marker's most copies in any: a bound that,
    # when within the request's, saves checking every tracked string (``lookup``).
    longest: int
    most: list[int]
    markers: list[str]  # the probed messages' markers, in order


class TemplateCache:
    """Renders of the model's own template through shapes (module docstring)."""

    def __init__(self, render: Render, *, size: int = 256, max_bytes: int = 16 << 20) -> None:
        self._render = render
        self.size = size
        self.max_bytes = max_bytes
        self._tag = f"\x00kvroute-{os.urandom(8).hex()}-"
        self._tag_bytes = self._tag.encode()
        self._shapes: OrderedDict[bytes, Shape | None] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _marker(self, i: int) -> str:
        return f"{self._tag}{i}\x00"

    def _key(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any], tools: Any
    ) -> tuple[bytes, list[int]] | None:
        """The shape's key (every input but the messages' texts) and the indexes of the
        messages whose text is probed (a string; other contents stay in the key)."""
        roles = []
        for m in messages:  # the common case: every message a role and a text, only
            if len(m) != 2 or type(m.get("content")) is not str or "role" not in m:
                break
            roles.append(m["role"])
        else:
            try:
                key = b"r" + orjson.dumps([roles, kwargs, tools])
            except TypeError:
                return None
            return None if self._tag_bytes in key else (key, list(range(len(messages))))
        probed = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
        if not probed:
            return None
        shape = [
            {k: v for k, v in m.items() if k != "content"}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        try:
            key = b"g" + orjson.dumps([shape, kwargs, tools])
        except TypeError:
            return None
        return None if self._tag_bytes in key else (key, probed)

    def lookup(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any], tools: Any, bounds: Bounds
    ) -> str | None:
        """The render from a learned shape, or None (render in full, then ``observe``)."""
        found = self._key(messages, kwargs, tools)
        if found is None:
            return None
        key, probed = found
        with self._lock:
            shape = self._shapes.get(key)
            if shape is not None:
                self._shapes.move_to_end(key)
        if shape is None or shape.steps > bounds.max_steps:
            self.misses += 1
            return None
        contents = [messages[i]["content"] for i in probed]
        tag = self._tag  # it starts with a NUL: a text without one (memchr) holds none
        for c in contents:
            if "\x00" in c and tag in c:
                self.misses += 1
                return None
        markers = shape.markers
        fills = dict(zip(markers, contents, strict=True))
        bound = shape.longest
        for k, c, m in zip(shape.most, contents, markers, strict=True):
            if len(c) > len(m):
                bound += k * (len(c) - len(m))
        if bound > bounds.max_chars:
            grow = [len(c) - len(m) for m, c in fills.items()]
            for n, copies in shape.sizes:  # the bound is over: check each tracked string
                if n + sum(k * g for k, g in zip(copies, grow, strict=True)) > bounds.max_chars:
                    self.misses += 1
                    return None
        if shape.questions and not _holds(fills, shape.questions):
            self.misses += 1
            return None
        self.hits += 1
        return "".join([fills.get(part, part) for part in shape.parts])

    def observe(
        self,
        messages: list[dict[str, Any]],
        kwargs: dict[str, Any],
        tools: Any,
        bounds: Callable[[], Bounds],
    ) -> None:
        """After a full render of the model's template: learn the shape if it is seen
        for the second time (synchronous, in the render's thread)."""
        found = self._key(messages, kwargs, tools)
        if found is None:
            return
        key, probed = found
        with self._lock:
            if key in self._shapes:
                return
            seen = hash(key)
            if seen not in self._seen:
                self._seen[seen] = None
                if len(self._seen) > 4 * self.size:
                    self._seen.popitem(last=False)
                return
        shape = self._learn(messages, probed, kwargs, tools, bounds)
        with self._lock:
            self._shapes[key] = shape  # None: this shape is not cacheable
            self._used += len(key) + (shape.cost if shape is not None else 0) + 100
            while self._shapes and (len(self._shapes) > self.size or self._used > self.max_bytes):
                old_key, old = self._shapes.popitem(last=False)
                self._used -= len(old_key) + (old.cost if old is not None else 0) + 100

    @staticmethod
    def _with(messages: list[dict[str, Any]], texts: dict[int, str]) -> list[dict[str, Any]]:
        return [{**m, "content": texts[i]} if i in texts else m for i, m in enumerate(messages)]

    def _learn(
        self,
        messages: list[dict[str, Any]],
        probed: list[int],
        kwargs: dict[str, Any],
        tools: Any,
        bounds: Callable[[], Bounds],
    ) -> Shape | None:
        rec = _Record()
        markers = {i: self._marker(i) for i in probed}
        try:
            b = bounds()
            probes = {i: Probe(m, rec) for i, m in markers.items()}
            text = self._render(self._with(messages, probes), kwargs, tools, b)  # type: ignore[arg-type]
            steps = b.steps
            if rec.tainted is not None:
                return None
            if self._render(self._with(messages, markers), kwargs, tools, bounds()) != text:
                return None
            # Every text at once awkward (or, where the template branches on that, bare
            # other markers), rendered for real against the cached render filled in.
            checks: dict[int, str] = {}
            for i, m in markers.items():
                tag = m.replace("kvroute", "check")
                pick = tag + AWKWARD
                if not _holds({m: pick}, [q for q in rec.questions if q[0] == m]):
                    pick = tag
                checks[i] = pick
            fills = {markers[i]: c for i, c in checks.items()}
            if not _holds(fills, rec.questions):
                return None
            full = self._render(self._with(messages, checks), kwargs, tools, bounds())
            want = text
            for marker, content in fills.items():
                want = want.replace(marker, content)
            if full != want:
                return None
        except Exception:  # the render's errors are the request's, already answered
            return None
        order = [markers[i] for i in probed]
        sizes = [(len(t), [t.count(m) for m in order]) for t in rec.derived | {text}]
        cost = sys.getsizeof(text) + sum(sys.getsizeof(q[0]) + 200 for q in rec.questions)
        parts = re.split("(" + "|".join(map(re.escape, order)) + ")", text)
        longest = max(n for n, _ in sizes)
        most = [max(copies[j] for _, copies in sizes) for j in range(len(order))]
        return Shape(text, rec.questions, steps, sizes, 2 * cost, parts, longest, most, order)

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "shapes": len(self._shapes)}
