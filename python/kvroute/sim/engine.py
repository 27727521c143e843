"""The request engine of ``kvroute sim-worker``: slots, prefill, decode, cache, events.

One ``SimEngine`` per process, driven by the HTTP app (``sim.worker``). It follows the
cost model (``sim.cost``) and the cache lifecycle (``sim.cache``) exactly as the fleet
simulator (``sim.fleet``) does, with real (scaled) sleeps instead of a virtual clock:

1. wait FIFO for one of ``max_batch`` slots and, with ``kv_admission``, for room for
   its prompt's blocks in the KV cache (``PrefixCache.fits``: the head of the queue
   waits until running requests free enough, and the rest behind it, as vLLM's
   scheduler does); ``vllm:num_requests_waiting`` meanwhile;
2. admitted: ``PrefixCache.admit_keys`` counts the cached prefix and stores + pins the
   prompt's blocks (KV events for stored and evicted blocks go out now, as one batch);
3. wait for the prefill engine (one prefill at a time, FIFO), sleep
   ``prefill_s(uncached)``; the first token is out;
4. the other tokens follow every ``decode_interval_s(batch)``, ``batch`` = requests
   running when it was admitted; the engine wakes whenever the sequence fills a block
   (``PrefixCache.grow`` stores and pins it, with its events) and, when streaming, every
   ``stream_interval`` tokens to send them;
5. finished (or cancelled: client gone): the blocks are unpinned, the slot freed.

Time: every sleep is model time divided by ``time_scale`` (S=10 runs 10x faster than real
time). Everything the worker *reports* (``/sim/stats``, ``meta_info.e2e_latency`` and
``ttft``) is model time: measured wall time multiplied by S. A client measures model
time / S plus HTTP and router overhead, so it multiplies its wall times by S to compare,
and every millisecond of real overhead then counts as S model milliseconds: keep S small
(<= 5) when client-side latencies are the result, or use the worker's own numbers.
Output tokens are deterministic filler (``FILLER``, token IDs ``cache.OUTPUT_TOKEN_IDS``);
``output_len`` is exactly what the request asked for (as with ``ignore_eos``). With
``output_blocks`` off, generated tokens take no cache blocks (the model before vLLM's
decode-block caching was simulated; kept to measure what those blocks change).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvroute.sim.cache import OUTPUT_TOKEN_IDS, Handle, PrefixCache
from kvroute.sim.cost import DEFAULT_BLOCK_SIZE, DEFAULT_CAPACITY_TOKENS, CostModel
from kvroute.sim.events import KVEventPublisher

FILLER = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " again")
FILLER_IDS = OUTPUT_TOKEN_IDS
MIN_WAKE_S = 0.005  # stream tokens in groups rather than wake more often than this


def filler_text(start: int, stop: int) -> str:
    return "".join(FILLER[i % len(FILLER)] for i in range(start, stop))


def filler_ids(n: int) -> list[int]:
    return [FILLER_IDS[i % len(FILLER_IDS)] for i in range(n)]


@dataclass
class SimConfig:
    model: str = "sim"
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    cost: CostModel = field(default_factory=CostModel)
    time_scale: float = 1.0
    max_model_len: int = 131_072
    tokenizer: str | None = None
    text_codec: str = "bytes"  # or "codepoints": one token per character (sim.textcodec)
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str | None = None
    request_log_size: int = 10_000
    # Tokens per streamed chunk after the first (vLLM's --stream-interval); fewer chunks
    # keep a benchmark's client and router from being the bottleneck on long outputs.
    stream_interval: int = 1
    output_blocks: bool = True  # generated tokens take cache blocks (vLLM does)
    # A request starts only when its prompt's blocks fit in the KV cache beside the
    # running requests' (vLLM, SGLang); off: up to max_batch run whatever the cache
    # holds (the model before; kept to measure what admission changes).
    kv_admission: bool = True
    # LoRA adapters served besides ``model`` (listed by /v1/models with ``parent``).
    lora_adapters: tuple[str, ...] = ()
    # Off: no prompt reuses another's blocks, no prefix-cache counters or KV events (as
    # vLLM with --no-enable-prefix-caching): lets `kvroute doctor` be tested on a fleet
    # configured wrong.
    prefix_caching: bool = True
    # /get_server_info tells how many requests run at once, as SGLang's does; off: it
    # does not, as vLLM publishes no max_num_seqs (the router learns it from queueing).
    reports_max_running: bool = True

    def validate(self) -> SimConfig:
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.block_size < 1 or self.capacity_tokens < 0:
            raise ValueError("--block-size must be >= 1 and --capacity-tokens >= 0")
        if self.text_codec not in ("bytes", "codepoints"):
            raise ValueError("--text-codec must be bytes or codepoints")
        if self.text_codec == "codepoints" and self.tokenizer is not None:
            raise ValueError("--text-codec codepoints and --tokenizer exclude each other")
        return self


@dataclass(slots=True)
class Run:
    """One request's accounting (model seconds). ``namespace``: its cache key namespace
    (``sim.cache.namespace_of``), ``lora``: (lora_id, name) of its adapter, if any."""

    rid: str
    prompt_tokens: int
    output_len: int
    namespace: int = 0
    lora: tuple[int, str] | None = None
    cached_tokens: int = 0
    output_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0  # its own prefill (cost model), without any wait
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    batch: int = 0
    finished: bool = False


class SimEngine:
    def __init__(self, config: SimConfig) -> None:
        self.config = config.validate()
        self.cost = config.cost
        self.scale = config.time_scale
        self._pending: list[dict[str, Any]] = []
        self.publisher: KVEventPublisher | None = None
        self._lora: tuple[int, str] | None = None
        if config.kv_events_endpoint:
            self.publisher = KVEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_topic,
                config.kv_events_replay_endpoint,
            )
        self.cache = PrefixCache(
            config.capacity_tokens,
            config.block_size,
            on_store=self._on_store if self.publisher else None,
            on_remove=self._on_remove if self.publisher else None,
            on_clear=self._on_clear if self.publisher else None,
        )
        # Requests waiting to start, first come first served: (resolved once it has
        # started, the request on its way in).
        self._queue: deque[tuple[asyncio.Future[None], _Admission]] = deque()
        self._prefill = asyncio.Lock()
        self.running = 0
        self.waiting = 0
        self.served = 0
        self.cancelled = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.log: deque[Run] = deque(maxlen=config.request_log_size)
        self.calls: Counter[str] = Counter()  # non-generation endpoints (render, tokenize)

    # ------------------------------------------------------------------ events

    def _on_store(self, hashes: list[int], parent: int | None, ids: list[int], bs: int) -> None:
        # The adapter of the request whose admit/grow stores these blocks (both run
        # synchronously, with ``_lora`` set around them).
        self._pending.append(KVEventPublisher.block_stored(hashes, parent, ids, bs, self._lora))

    def _on_remove(self, hashes: list[int]) -> None:
        self._pending.append(KVEventPublisher.block_removed(hashes))

    def _on_clear(self) -> None:
        self._pending.append(KVEventPublisher.all_cleared())

    def _flush_events(self) -> None:
        if self._pending and self.publisher is not None:
            self.publisher.publish(self._pending)
        self._pending = []

    def flush_cache(self) -> int:
        n = self.cache.num_blocks
        self.cache.clear()
        self._flush_events()
        return n

    def restart(self) -> None:
        """Fault injection: what a subscriber sees of an engine restart. The cache is
        emptied without an ``AllBlocksCleared`` event and event numbering restarts at 0."""
        self.cache.clear()
        self._pending = []
        if self.publisher is not None:
            self.publisher.reset_seq()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------ requests

    async def generate(
        self, run: Run, tokens: Sequence[int], stream: bool = True
    ) -> AsyncGenerator[int, None]:
        """Serve one request; yields the number of output tokens out so far (1 first,
        ``run.output_len`` last). Close it (``contextlib.aclosing``) if abandoned.

        ``stream=False`` yields only the first and the last token; streaming yields every
        ``stream_interval`` tokens, grouped further so that it wakes at most every
        ``MIN_WAKE_S`` of wall time, without delaying the last token. Either way the
        engine also wakes when the sequence fills a block, to cache it."""
        scale = self.scale
        cache = self.cache
        t0 = time.perf_counter()
        entry = _Admission(self, run, tokens)
        try:
            await self._admit(entry)
            handle = entry.handle
            run.queue_s = (entry.t_admit - t0) * scale
            self.prompt_tokens += run.prompt_tokens
            run.prefill_s = self.cost.prefill_s(run.prompt_tokens - run.cached_tokens)
            async with self._prefill:
                await asyncio.sleep(run.prefill_s / scale)
            t_first = time.perf_counter()
            run.ttft_s = (t_first - t0) * scale
            run.output_tokens = 1
            yield 1
            interval = self.cost.decode_interval_s(run.batch) / scale
            total = run.output_len
            n = run.prompt_tokens
            step = self.config.stream_interval if stream else total
            last_due = t_first + (total - 1) * interval
            sent = 1
            while run.output_tokens < total:
                # Wake for the next chunk to send or the next block to cache, if sooner.
                target = min(total, sent + step)
                fill = cache.next_fill(handle) if handle is not None else None
                if fill is not None:
                    target = min(target, max(fill - n + 1, run.output_tokens + 1))
                now = time.perf_counter()
                wait = max(t_first + (target - 1) * interval - now, MIN_WAKE_S)
                wait = min(wait, last_due - now)
                if wait > 0:
                    await asyncio.sleep(wait)
                elapsed = time.perf_counter() - t_first
                out = total if interval <= 0 else min(total, 1 + int(elapsed / interval + 1e-9))
                run.output_tokens = max(out, run.output_tokens + 1)
                # The KV of every output token but the newest is computed by now.
                if handle is not None:
                    self._lora = run.lora
                    cache.grow(handle, n + run.output_tokens - 1)
                    self._lora = None
                self._flush_events()
                if run.output_tokens >= min(total, sent + step):
                    sent = run.output_tokens
                    yield sent
            run.e2e_s = (time.perf_counter() - t0) * scale
            run.finished = True
        finally:
            if entry.admitted:
                if entry.handle is not None:
                    self.cache.release(entry.handle)
                self.running -= 1
                self._wake()
            self.generation_tokens += run.output_tokens
            if run.finished:
                self.served += 1
            else:
                self.cancelled += 1
            self.log.append(run)

    async def _admit(self, entry: _Admission) -> None:
        """Start ``entry``'s request now if nothing waits and it fits, else queue it
        until ``_wake`` starts it (``entry.admitted``)."""
        if not self._queue and entry.fits():
            entry.start()
            return
        done = asyncio.get_running_loop().create_future()
        self._queue.append((done, entry))
        self.waiting += 1
        try:
            await done
        finally:
            if not entry.admitted:  # cancelled while waiting (client gone)
                self.waiting -= 1
                self._queue.remove((done, entry))
                self._wake()  # the head may have been what held the others

    def _wake(self) -> None:
        """Start the waiting requests from the head while each fits."""
        queue = self._queue
        while queue:
            done, entry = queue[0]
            if not entry.fits():
                return
            queue.popleft()
            self.waiting -= 1
            entry.start()
            if not done.done():
                done.set_result(None)

    # ------------------------------------------------------------------ reporting

    def stats(self, with_log: bool = False) -> dict[str, Any]:
        c = self.cache
        out: dict[str, Any] = {
            "model": self.config.model,
            "time_scale": self.scale,
            "block_size": c.block_size,
            "capacity_tokens": c.capacity_tokens,
            "cached_tokens": c.cached_tokens,
            "cached_blocks": c.num_blocks,
            "pinned_blocks": c.pinned_blocks,
            "evicted_blocks": c.evicted_blocks,
            "kv_cache_usage": c.usage(),
            "prefix_cache_queries": c.queries,
            "prefix_cache_hits": c.hits,
            "hit_rate": c.hits / c.queries if c.queries else 0.0,
            "requests_served": self.served,
            "requests_cancelled": self.cancelled,
            "running": self.running,
            "waiting": self.waiting,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "calls": dict(self.calls),
        }
        if self.publisher is not None:
            p = self.publisher
            out["kv_events"] = {"seq": p.seq, "sent": p.sent, "dropped": p.dropped}
        if with_log:
            out["requests"] = [asdict(r) for r in self.log]
        return out

    def reset_stats(self) -> None:
        self.cache.reset_counters()
        self.served = self.cancelled = self.prompt_tokens = self.generation_tokens = 0
        self.log.clear()
        self.calls.clear()

    def metrics_text(self) -> str:
        c = self.cache
        labels = f'{{engine="0",model_name="{self.config.model}"}}'
        rows = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Requests in model execution batches.",
                self.running,
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Requests waiting to be processed.",
                self.waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                c.usage(),
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "Deprecated name of kv_cache_usage_perc.",
                c.usage(),
            ),
            ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.", 1),
            ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in tokens.", c.queries),
            ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in tokens.", c.hits),
            ("vllm:prompt_tokens", "counter", "Prefill tokens processed.", self.prompt_tokens),
            (
                "vllm:generation_tokens",
                "counter",
                "Generation tokens processed.",
                self.generation_tokens,
            ),
            ("vllm:request_success", "counter", "Successfully processed requests.", self.served),
        ]
        # vLLM exports its cache settings as the labels of a constant gauge.
        info = (
            f'{{block_size="{c.block_size}",'
            f'enable_prefix_caching="{self.config.prefix_caching}",'
            f'num_gpu_blocks="{c.capacity_tokens // c.block_size}"}}'
        )
        lines = []
        for name, kind, doc, value in rows:
            sample = f"{name}_total" if kind == "counter" else name
            lines += [
                f"# HELP {name} {doc}",
                f"# TYPE {name} {kind}",
                f"{sample}{info if name == 'vllm:cache_config_info' else labels} {float(value)}",
            ]
        return "\n".join(lines) + "\n"


class _Admission:
    """A request on its way into the engine: its cache keys (computed once), whether it
    fits now, and its start (slot taken, blocks pinned, ``t_admit``)."""

    __slots__ = ("admitted", "engine", "handle", "keys", "n_tokens", "run", "seq", "t_admit")

    def __init__(self, engine: SimEngine, run: Run, tokens: Sequence[int]) -> None:
        self.engine = engine
        self.run = run
        self.keys: list[int] | None = None
        self.n_tokens = len(tokens)
        self.seq: Any = None
        if engine.config.prefix_caching:
            out = run.output_len if engine.config.output_blocks else 1
            self.keys, self.n_tokens, self.seq = engine.cache.prepare(tokens, out, run.namespace)
        self.handle: Handle | None = None
        self.admitted = False
        self.t_admit = 0.0

    def fits(self) -> bool:
        e = self.engine
        if e.running >= e.cost.max_batch:
            return False
        if self.keys is None or not e.config.kv_admission:
            return True
        return e.cache.fits(self.keys, self.n_tokens)

    def start(self) -> None:
        e, run = self.engine, self.run
        self.admitted = True
        self.t_admit = time.perf_counter()
        e.running += 1
        run.batch = e.running
        if self.keys is not None:
            e._lora = run.lora
            run.cached_tokens, self.handle = e.cache.admit_keys(
                self.keys, self.n_tokens, self.seq if e.cache.on_store is not None else None
            )
            e._lora = None
            self.keys = self.seq = None
        e._flush_events()
