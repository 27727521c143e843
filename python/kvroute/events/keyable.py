"""Which reported blocks kvroute can key by their token IDs alone.

kvroute keys a block by a chain hash of its tokens, so a block whose engine hash also
depends on something else must not be indexed, or a plain-text request would match
it. Ignored, with all their descendants:

* LoRA blocks (``lora_id`` / ``lora_name``): the same tokens under another adapter,
  unless the tracker keeps a partition per adapter (``named_lora``) and the event names
  its adapter (vLLM sends ``lora_name``; an ID alone cannot be matched to a request);
* blocks with ``extra_keys`` (multimodal inputs, ``cache_salt``, prompt embeddings),
  from the first such block of an event on;
* media other than the GPU cache (``medium`` "CPU" / "STORAGE": offloaded copies whose
  removals must not remove the GPU copy);
* KV cache groups other than the first full-attention group seen (hybrid models report
  each group; a sliding-window group evicts early);
* SGLang's partial last page (tokens short of a whole block).

The hashes of ignored blocks are remembered until removed, so a later event naming one
as its parent is ignored too instead of looking like a lost event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.events.decode import BlockStored


@dataclass
class KeyableFilter:
    """One worker's filter state (reset with the worker's blocks)."""

    group: int | None = None  # the KV cache group whose events are applied
    ignored: set[int] = field(default_factory=set)  # engine hashes of ignored blocks

    def clear(self) -> None:
        self.group = None
        self.ignored.clear()

    def wanted(self, medium: str | None, group: int | None, kind: str | None = None) -> bool:
        """Whether an event on ``medium`` / ``group`` concerns the cache kvroute tracks."""
        if medium not in (None, "GPU"):
            return False
        if group is None:
            return True
        if self.group is None and kind in (None, "full_attention"):
            self.group = group
        return group == self.group

    def keyable(self, ev: BlockStored, named_lora: bool = False) -> int:
        """How many leading blocks of ``ev`` to index; the rest are remembered as ignored.
        ``named_lora``: blocks of a named LoRA adapter are indexable (in its partition)."""
        keep = self._keyable(ev, named_lora)
        self.ignored.update(ev.block_hashes[keep:])
        return keep

    def removed(self, hashes: list[int]) -> None:
        self.ignored.difference_update(hashes)

    def _keyable(self, ev: BlockStored, named_lora: bool) -> int:
        if ev.lora_id is not None or ev.lora_name is not None:
            if not (named_lora and ev.lora_name):
                return 0
        if ev.parent_block_hash is not None and ev.parent_block_hash in self.ignored:
            return 0
        n = min(len(ev.block_hashes), len(ev.token_ids) // ev.block_size)  # partial page
        if ev.extra_keys is not None:
            for i, extra in enumerate(ev.extra_keys[:n]):
                if extra is not None:
                    return i
        return n
