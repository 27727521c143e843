"""Which models each worker serves, and the cache partition a request belongs to.

A fleet behind one endpoint may serve several base models, and vLLM serves LoRA adapters
as extra model names (``GET /v1/models`` lists an adapter with ``parent`` set to its base
model). A request is routed only among the workers that serve its ``model``:

* each worker's models come from its ``GET /v1/models``, read when it joins and again
  after each good health check, so an adapter loaded or unloaded at run time (or a
  replica restarted with another model) moves the worker in or out of that model's
  rotation; or they are set by the operator (``--worker-models``, ``POST /workers``
  with ``models``), and then never read;
* a worker whose models are not known (it has no ``/v1/models``, or the first read has
  not answered yet) serves any model: a fleet whose workers list nothing routes exactly
  as before;
* a request without a model (SGLang's ``/generate``) asks for ``--default-model``; with
  no default every worker is eligible.

Cache partitions. Engines key every cached block by its tokens *and* by what else
changes its KV: vLLM hashes the LoRA adapter's name into every block and the request's
``cache_salt`` into the first (so into every later one, the hashes being chained). The
same tokens under another adapter or salt share no KV. The router's index is therefore
partitioned by (adapter, salt): a request in a partition other than the base model's
unsalted one has one *partition token* put in front of its token IDs before the index
sees them. Token IDs are below 2**31 in every tokenizer (and below 256 in byte mode), so
a token in ``[0xF0000000, 0xFFFFFFFF]`` derived from a hash of (adapter, salt) can never
match a real prompt: no match crosses partitions, while each worker's token budget is
still one LRU shared by all its partitions. Base models need no partition token: one
worker serves one base model, so two base models never share a worker's cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PARTITION_BASE = 0xF000_0000
PARTITION_SPAN = 0x0FFF_FFFF


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of a worker's ``/v1/models``: ``parent`` is the base model of an adapter."""

    id: str
    parent: str | None = None
    raw: Mapping[str, Any] | None = None

    @property
    def is_adapter(self) -> bool:
        return self.parent is not None and self.parent != self.id


def parse_models(body: Any) -> list[ServedModel] | None:
    """The models an OpenAI-style ``/v1/models`` answer lists, or None when the body is
    not such a list (the worker's models then stay unknown)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    out: list[ServedModel] = []
    for m in data:
        if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]:
            parent = m.get("parent")
            out.append(ServedModel(m["id"], parent if isinstance(parent, str) else None, m))
    return out


def named_models(names: list[str]) -> list[ServedModel]:
    """Models named by the operator: the first is the base model, the others its LoRA
    adapters (vLLM serves one base model per replica)."""
    base = names[0]
    return [ServedModel(base)] + [ServedModel(n, base) for n in names[1:] if n != base]


def partition_token(adapter: str | None, salt: str | None) -> int | None:
    """The token put before a request's IDs in the index: None for the base model's
    unsalted partition, else a value no tokenizer produces (see the module docstring)."""
    if not adapter and not salt:
        return None
    key = f"{adapter or ''}\0{salt or ''}".encode()
    digest = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return PARTITION_BASE | (digest % PARTITION_SPAN)


def adapter_partition(adapter: str) -> int:
    """The partition token of LoRA ``adapter``'s unsalted requests (its KV events' blocks
    are kept under it in precise mode)."""
    token = partition_token(adapter or "?", None)
    assert token is not None
    return token


class ModelLabels:
    """Model names as a bounded metric label: the first ``cap`` distinct names keep
    their own label, later ones share ``other`` (a client cannot grow the series)."""

    def __init__(self, cap: int = 32) -> None:
        self.cap = cap
        self._seen: set[str] = set()

    def __call__(self, model: str | None) -> str:
        if model is None:
            return "default"
        if model in self._seen:
            return model
        if len(self._seen) < self.cap:
            self._seen.add(model)
            return model
        return "other"


def listing(models: Iterable[ServedModel]) -> list[dict[str, Any]]:
    """``/v1/models`` data with each model once (the first worker's entry wins)."""
    seen: dict[str, dict[str, Any]] = {}
    for m in models:
        if m.id not in seen:
            seen[m.id] = dict(m.raw) if m.raw is not None else {"id": m.id, "object": "model"}
    return list(seen.values())


def requested_model(kind: str, body: Mapping[str, Any], default: str | None) -> str | None:
    """The model a request asks for: the body's ``model`` on the OpenAI routes (None
    when absent), ``default`` for SGLang's ``/generate``, which names none. ValueError
    when ``model`` is there but not a non-empty string."""
    if kind == "generate":
        return default
    model = body.get("model")
    if model is None:
        return default
    if not isinstance(model, str) or not model:
        raise ValueError("'model' must be a non-empty string")
    return model


def request_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's ``cache_salt`` (a string; anything else is the engine's to refuse)."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def generate_adapter(body: Mapping[str, Any]) -> str | None:
    """SGLang's ``/generate`` names its LoRA adapter in ``lora_path``."""
    lora = body.get("lora_path")
    if isinstance(lora, list):
        lora = lora[0] if lora else None
    return lora if isinstance(lora, str) and lora else None
