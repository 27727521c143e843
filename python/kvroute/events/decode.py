"""Decode KV cache event batches as vLLM and SGLang publish them (docs/kv-events.md).

A ZMQ message is ``[topic, seq, payload]``; the payload is msgpack of
``[ts, events]`` or ``[ts, events, data_parallel_rank]``. Each event is either a map
with a ``"type"`` key (current vLLM) or a positional array with the tag first (older
vLLM, SGLang) whose trailing fields may be omitted. Unknown keys are ignored; events
of an unknown type are skipped and counted in ``KvEventBatch.unknown``.

Anything else that does not have this shape raises ``KvEventDecodeError`` for the
whole batch: a batch is applied entirely or not at all, because skipping a single
``BlockRemoved`` would leave blocks in the index that the engine no longer holds.

Block hashes arrive as u64 (vLLM), signed i64 (SGLang) or raw bytes (vLLM with bytes
hashes). Ints are kept as they are; bytes become ``int.from_bytes(last 8 bytes, "big")``,
the same conversion for ``BlockStored`` and ``BlockRemoved`` so removals still apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)


class KvEventDecodeError(ValueError):
    """A message or payload is not a KV event batch; the subscriber counts it as dropped."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly cached by the engine; ``token_ids`` covers all of them in order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block (None: the block's hash depends on its tokens only).
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from ``medium`` (None means the GPU / main KV cache)."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine reset its prefix cache: it holds nothing any more."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None
    unknown: int = 0  # events of a type this decoder does not know (skipped)


def parse_seq(frame: bytes) -> int:
    """The sequence number frame: 8 bytes, big-endian, unsigned."""
    if len(frame) != 8:
        raise KvEventDecodeError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_batch(payload: bytes) -> KvEventBatch:
    """Decode one msgpack payload into a batch; raise ``KvEventDecodeError`` if malformed."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise KvEventDecodeError(f"payload is not msgpack: {e}") from None
    if not isinstance(obj, list | tuple) or len(obj) not in (2, 3):
        raise KvEventDecodeError("payload must be [ts, events] or [ts, events, dp_rank]")
    ts, raw_events = obj[0], obj[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvEventDecodeError(f"batch timestamp must be a number, got {type(ts).__name__}")
    if not isinstance(raw_events, list | tuple):
        raise KvEventDecodeError("batch events must be an array")
    rank = obj[2] if len(obj) == 3 else None
    if rank is not None and not _is_int(rank):
        raise KvEventDecodeError("data_parallel_rank must be an int or null")
    events: list[KvEvent] = []
    unknown = 0
    for raw in raw_events:
        event = decode_event(raw)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return KvEventBatch(float(ts), events, rank, unknown)


def decode_event(raw: Any) -> KvEvent | None:
    """One event in either encoding; None for an event type this decoder does not know."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        if tag == "BlockStored":
            return _stored(
                _req(raw, "block_hashes"),
                raw.get("parent_block_hash"),
                _req(raw, "token_ids"),
                _req(raw, "block_size"),
                raw.get("lora_id"),
                raw.get("medium"),
                raw.get("lora_name"),
                raw.get("extra_keys"),
                raw.get("group_idx"),
                raw.get("kv_cache_spec_kind"),
            )
        if tag == "BlockRemoved":
            return _removed(_req(raw, "block_hashes"), raw.get("medium"), raw.get("group_idx"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        if not isinstance(tag, str):
            raise KvEventDecodeError("map event without a string 'type'")
        return None
    if isinstance(raw, list | tuple):
        if not raw or not isinstance(raw[0], str):
            raise KvEventDecodeError("array event must start with its type tag")
        tag, fields = raw[0], raw[1:]
        if tag == "BlockStored":
            if len(fields) < 4:
                raise KvEventDecodeError("BlockStored needs hashes, parent, token_ids, block_size")
            # Fields after lora_name differ between versions: ignore them.
            return _stored(*fields[:4], *_opt(fields, 4, 3))
        if tag == "BlockRemoved":
            if len(fields) < 1:
                raise KvEventDecodeError("BlockRemoved needs block_hashes")
            return _removed(fields[0], *_opt(fields, 1, 1))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise KvEventDecodeError(f"event must be a map or an array, got {type(raw).__name__}")


def normalize_hash(h: Any) -> int:
    """An engine block hash as an int (u64 and i64 kept; bytes: their last 8, big-endian)."""
    if isinstance(h, bytes | bytearray):
        if not h:
            raise KvEventDecodeError("empty bytes block hash")
        return int.from_bytes(h[-8:], "big")
    if _is_int(h) and _I64_MIN <= h <= _U64_MAX:
        return int(h)
    raise KvEventDecodeError(f"block hash must be a 64-bit int or bytes, got {h!r:.40}")


def _stored(
    hashes: Any,
    parent: Any,
    token_ids: Any,
    block_size: Any,
    lora_id: Any = None,
    medium: Any = None,
    lora_name: Any = None,
    extra_keys: Any = None,
    group_idx: Any = None,
    kind: Any = None,
) -> BlockStored:
    if not _is_int(block_size) or block_size <= 0:
        raise KvEventDecodeError(f"block_size must be a positive int, got {block_size!r:.40}")
    if not isinstance(token_ids, list | tuple) or not all(_is_int(t) for t in token_ids):
        raise KvEventDecodeError("token_ids must be an array of ints")
    if extra_keys is not None and not isinstance(extra_keys, list | tuple):
        raise KvEventDecodeError("extra_keys must be an array or null")
    return BlockStored(
        block_hashes=_hashes(hashes),
        parent_block_hash=None if parent is None else normalize_hash(parent),
        token_ids=list(token_ids),
        block_size=int(block_size),
        lora_id=_opt_int(lora_id, "lora_id"),
        medium=_opt_str(medium, "medium"),
        lora_name=_opt_str(lora_name, "lora_name"),
        extra_keys=None if extra_keys is None else list(extra_keys),
        group_idx=_opt_int(group_idx, "group_idx"),
        kv_cache_spec_kind=_opt_str(kind, "kv_cache_spec_kind"),
    )


def _removed(hashes: Any, medium: Any = None, group_idx: Any = None) -> BlockRemoved:
    return BlockRemoved(
        _hashes(hashes), _opt_str(medium, "medium"), _opt_int(group_idx, "group_idx")
    )


def _hashes(raw: Any) -> list[int]:
    if not isinstance(raw, list | tuple):
        raise KvEventDecodeError("block_hashes must be an array")
    return [normalize_hash(h) for h in raw]


def _req(m: Mapping[Any, Any], key: str) -> Any:
    try:
        return m[key]
    except KeyError:
        raise KvEventDecodeError(f"{m.get('type')} event without {key!r}") from None


def _opt(fields: Sequence[Any], start: int, n: int) -> list[Any]:
    """Positional trailing fields ``start .. start+n``; omitted ones are None."""
    got = list(fields[start : start + n])
    return got + [None] * (n - len(got))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt_int(x: Any, name: str) -> int | None:
    if x is None or _is_int(x):
        return x  # type: ignore[no-any-return]
    raise KvEventDecodeError(f"{name} must be an int or null")


def _opt_str(x: Any, name: str) -> str | None:
    if x is None or isinstance(x, str):
        return x
    raise KvEventDecodeError(f"{name} must be a string or null")
