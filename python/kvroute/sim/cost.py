"""The cost model of a simulated inference server, shared by ``sim-worker`` and the
fleet simulator so that both predict the same times.

A worker runs at most ``max_batch`` requests at once; the rest wait in FIFO order.
Prompts are prefilled one at a time in admission order (a replica's prefill throughput
is a property of the GPU, not of the request: batching prefills does not make them
cheaper in total), so a request's time to first token is

    TTFT = wait for a slot + wait for the prefill engine
           + overhead_s + uncached_prompt_tokens / prefill_tokens_per_s

Cached tokens (leading full blocks found in the worker's prefix cache when its prefill
starts) cost nothing. After the first token, the remaining ``output_len - 1`` tokens
come one per ``decode_interval_s(batch)``, where ``batch`` is the number of requests
running on the worker when its decode starts (fixed for the request's lifetime: an
approximation that keeps the simulation event-driven):

    decode interval = decode_s_per_token * (1 + decode_batch_slowdown * (batch - 1))

Defaults and where they come from:

* ``prefill_tokens_per_s = 15_000``: an 8B model in bf16 on one H100 prefills on the
  order of 10k-20k tokens/s (about 2 * 8e9 FLOP per token against ~400 TFLOP/s of
  achievable dense bf16, with attention overhead on long prompts).
* ``overhead_s = 0.005``: scheduling, sampling and HTTP handling per request.
* ``decode_s_per_token = 0.020``: ~50 tokens/s for one sequence, memory-bound (16 GB of
  weights read per step at ~2-3 TB/s gives 6-8 ms ideal; serving stacks see 10-25 ms).
* ``decode_batch_slowdown = 0.02``: steps slow by ~2% per extra sequence in the batch
  (KV reads grow with the batch; weights are read once per step).
* ``max_batch = 32``: concurrent sequences per replica.
* ``capacity_tokens = 200_000``: ~25 GB of KV at 128 KiB per token (Llama-3-8B: 32
  layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes); about half of what one H100
  has left after the weights, so that cache pressure shows at benchmark sizes.
* ``block_size = 16``: vLLM's default KV block size.

These defaults are an estimate for GPU serving, not a fit to a measured engine. The one
engine this project can run, vLLM's CPU build on a tiny random-weight Llama (docs/real-engine.md:
2,000-token prompts, one request at a time, one core per replica), measured cold
~580 ms, 90% shared prefix ~110 ms, the same prompt again ~55 ms. ``VLLM_CPU`` is the
cost model fitted to it: a line through the cold and the 90%-shared points, with
vLLM's CPU block of 128 tokens (90% shared = 1,792 cached, 208 uncached; the same
prompt = 1,920 cached, 80 uncached): 3,800 prefill tokens/s and 50 ms of overhead,
which gives 576 ms cold and 105 ms at 90% shared, and 71 ms for the same prompt
(16 ms over what was measured: the line is not fitted to that point). Only prefill was
fitted; decode and batch numbers keep the defaults. The work model
(``kvroute.routing.load``) learns the same two numbers (overhead, tokens/s) per worker
online, so ``min_ttft`` does not depend on this calibration.

Generated tokens take cache blocks as prompt tokens do (``sim.cache``: each block the
prompt + output sequence fills is cached and pinned while the request runs, then stays
evictable), so long outputs compete with prompts for ``capacity_tokens``. A request whose
blocks do not fit next to the pinned blocks of running requests is still served at the
same cost; the blocks that do not fit are simply not cached (no preemption is modelled).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_TOKENS_PER_S = 15_000.0
DEFAULT_OVERHEAD_S = 0.005
DEFAULT_DECODE_S_PER_TOKEN = 0.020
DEFAULT_DECODE_BATCH_SLOWDOWN = 0.02
DEFAULT_MAX_BATCH = 32
DEFAULT_CAPACITY_TOKENS = 200_000
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    overhead_s: float = DEFAULT_OVERHEAD_S
    decode_s_per_token: float = DEFAULT_DECODE_S_PER_TOKEN
    decode_batch_slowdown: float = DEFAULT_DECODE_BATCH_SLOWDOWN
    max_batch: int = DEFAULT_MAX_BATCH

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be > 0")
        if self.overhead_s < 0 or self.decode_s_per_token < 0:
            raise ValueError("overhead_s and decode_s_per_token must be >= 0")
        if self.decode_batch_slowdown < 0:
            raise ValueError("decode_batch_slowdown must be >= 0")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")

    def prefill_s(self, uncached_tokens: int) -> float:
        """Model seconds to prefill a prompt with this many uncached tokens."""
        return self.overhead_s + max(uncached_tokens, 0) / self.prefill_tokens_per_s

    def decode_interval_s(self, batch: int) -> float:
        """Model seconds between two output tokens with ``batch`` requests running."""
        return self.decode_s_per_token * (1.0 + self.decode_batch_slowdown * max(batch - 1, 0))

    def decode_s(self, output_tokens: int, batch: int) -> float:
        """Model seconds from the first to the last of ``output_tokens`` tokens."""
        return max(output_tokens - 1, 0) * self.decode_interval_s(batch)


# vLLM's CPU build on this project's test model (see the module docstring).
VLLM_CPU = CostModel(prefill_tokens_per_s=3_800.0, overhead_s=0.050)
