"""Load in units of work: what each worker still has to do, how fast it does it, and the
time to first token (TTFT) a request would see there.

One ``LoadModel`` per router process (and per simulated router replica: the fleet
simulator runs this same code in virtual time). Every time argument is a caller's clock
in seconds (``time.monotonic()`` in ``serve``, virtual time in ``kvroute.sim.fleet``).

What is counted, per worker
    * **prefill work**: the *uncached* prompt tokens of every request routed there whose
      first byte has not come back yet, as predicted from the index match at decision
      time (``reserve``). Released when the first byte arrives (``Ticket.first_byte``).
    * **decode work**: the requests in flight and their expected output tokens
      (``max_tokens`` / ``max_completion_tokens`` / ``max_new_tokens`` when the request
      sets one, else a running mean of observed outputs). Released when the request ends
      (``Ticket.end``; which also releases the prefill part if no byte ever came back).
    Both are released exactly once whatever ends the request, like the registry's
    ``Reservation``; ``serve`` chains the ticket's ``end`` to that reservation's release.
    * **what other routers and bypassing clients put there**, from the engines' own
      readings (``observe_engine``: vLLM ``num_requests_running/waiting`` and
      ``kv_cache_usage_perc``, SGLang's running/queued counts): requests beyond ours
      count for the slot term below, and waiting ones beyond ours count as that many
      requests of the mean uncached size of ours.
    * **other router replicas'** (``--state-store``, ``kvroute.fleet.shared``): their
      requests in flight (``peer``: slots), and their queued prefill, shared as it
      changes (``peer_pending`` requests waiting for a first byte, ``peer_prefill``
      their uncached tokens): added to the queue ahead exactly as ours, and not counted
      again among an engine's waiting requests; and when their decoding requests are
      expected to end (``peer_ends``: a full worker's slot frees then, as at ours).
      ``on_change`` tells the store each time one of our requests is reserved, has its
      first byte or ends.

Learned speed, per worker (so a heterogeneous fleet is told apart)
    * prefill: time to first byte = ``overhead + uncached tokens / rate``, a line fitted
      to (uncached tokens, seconds from decision to first byte) samples
      (``ResistantLine``: a Theil-Sen slope on paired samples, the median residual as
      overhead; bounded window of ``WINDOW`` samples). A request routed to a free slot
      with none of the engine's other requests waiting gives a sample of its own prefill
      time: from its routing when nothing of ours was queued ahead of it, else (prefills
      run one at a time, in arrival order) from the first byte of the request just ahead
      of it, when it was the oldest still waiting. A busy worker so keeps learning; were
      only idle requests measured, a worker whose speed is overestimated would draw
      traffic, never be idle, and never be corrected. The sample is taken at the request's end,
      when the engine may have reported what it really had cached (``usage``
      ``prompt_tokens`` - ``cached_tokens``, in the router's token units): the index's
      guess is used only when it did not, so an evicted prefix the index still believed
      in does not pass for a slow worker.
    * index trust: the share of the cached tokens the index predicted that the engine
      reported it really had (EWMA, prior 1). The index only guesses (evictions, other
      routers, restarts); where its guesses fail, a predicted match is worth that much
      less: a request is expected to prefill ``uncached + (1 - trust) * matched``. Only
      what the engine could report is checked: engines cache whole blocks and never a
      prompt's last token, so the predicted match is rounded down to whole blocks of the
      worker's cache unit, learned as the greatest common divisor of the cached counts
      it reported (the fleet's until it has reported one); a match shorter than a block
      is no evidence. Prompts often share a few leading tokens with one routed before (a
      template's opening, text by chance): counted as failed predictions they took trust
      to the share of requests that were real hits, and every long match, predicted
      right, was then taken for a mostly cold prefill.
    * decode seconds per token: at each end with a known output length,
      ``(end - first byte) / (output tokens - 1)``, the median of the last ``WINDOW``
      (shown in ``/workers``), and as a line in the batch the request decoded in
      (``token(w, batch)``: the requests running, ours and others', at its first byte,
      at most the capacity; a ``ResistantLine`` over batch-size classes), since an
      engine steps slower with more requests running.
    Before ``MIN_SAMPLES`` samples a worker is assumed to prefill as the fleet's typical
    worker does (the median intercept and slope of the workers that learned), or along
    a line known from outside when one was given (``LoadModel.know``: the simulator's
    ``known_speeds``); before any did, the priors hold: ``PRIOR_PREFILL_TPS`` (the
    simulator's default worker, an 8B model on one H100), ``PRIOR_OVERHEAD_S``,
    ``PRIOR_DECODE_S``.
    Medians shrug off the outliers a shared machine or a stall produce. A worker that
    leaves (or goes down) forgets what was learned (it may come back as other hardware).

The prediction (``ttft``), for a request with ``uncached`` tokens on worker ``w``::

    ahead   = prefill queued on w, in seconds: its requests' overheads and uncached
              tokens over the learned line, the oldest (the one being prefilled) as
              what is left of it: its predicted prefill less the time since it began
              (when it was routed, or when the one ahead of it gave its first byte;
              nothing when overdue). Where that start is unknown (it was routed while
              the engine had others' requests waiting or no free slot, or the model
              has no clock: ``LoadModel.clock``) it counts half done, the average.
              When the oldest is another router replica's (``--state-store``), it
              began when this router heard their waiting requests there go from
              none to some, or one of them have its first byte with more waiting
              (``LoadModel.peer_queue_moved``), unless one of ours began first: what
              is left of a prefill of their mean size.
              + others' waiting requests, each of the mean uncached size of ours
    ttft    = ahead + overhead(w) + uncached / rate(w) + max(slot_wait(w), kv_wait(w))
    slot_wait = 0 while w has a free slot (requests in flight, ours + others, below its
              capacity: ``--worker-capacity`` or learned from the engines; a worker not
              yet seen queueing is assumed to have the largest capacity learned on any
              worker, since the engines are read only every few seconds and a queue
              that forms between two readings teaches nothing, unless it was seen
              running more than that with nothing waiting: it is larger, and then
              the fleet is not alike, so no worker not yet seen queueing is assumed
              any capacity until it queues); else the
              request waits for the (n - capacity + 1)-th of the running requests to
              end. Ours past their first byte end when their expected output is out:
              first byte + (expected output - 1) * token(w, batch), batch the
              requests running when it began to decode, and at least one token from
              now; other router replicas' decoding requests at the ends their
              routers published (``peer_ends``, through the store); requests of
              unknown progress (others', peers' not published) after an even
              share of a mean decode (the k-th of m after k / (m + 1) of
              mean_expected_output * token(w, capacity)), and ours still in prefill
              after a whole one. Without a clock, or with the queue deeper than the
              running requests, the k-th of ``capacity`` ends after k / (capacity +
              1) of a mean decode. An even spread of the *mean* decode misjudged
              both ways: short answers among the running ones free a slot much
              sooner, and a batch decoding slower than the fleet's median request
              later (module doc of ``LoadModel._release``; docs/policies.md)
    A worker whose engine reports its KV cache >= ``KV_FULL`` full is treated as having
    no free slot (the engine cannot admit more), with its running count as capacity.
    kv_wait = 0 while the request's prompt fits in the worker's KV cache beside the
              requests in flight; else the wait for enough of them to end. Engines
              admit a waiting request only when its prompt's blocks not already in use
              fit in the free ones (vLLM's scheduler, SGLang's token budget), first come
              first served, whatever decode slots are free. Counted: the KV capacity
              each engine reports (``IndexBudget.kv_units``: vLLM's
              ``cache_config_info``, SGLang's ``max_total_num_tokens``; none reported,
              none predicted), the prompt tokens each of our requests in flight keeps
              there (``reserve``'s ``kv``: its prompt less the longest prefix it shares
              with another of ours in flight on that worker, as the policies' prompts
              in flight tell once the index's budget has evicted; before that its
              uncached tokens, as the index then still holds every routed prompt), and
              others' from the engine's KV usage beyond ours (only where requests not
              ours run). Room frees as ours decoding end, soonest first, each its
              tokens; the rest is freed one request lifetime (a prefill of the mean
              uncached size and a mean decode) per cache's worth. A routed request's
              predicted TTFT (its ticket's: checked against its first byte, and what
              the first-byte deadline reads) counts the longer of slot_wait and
              kv_wait; choices (``predict``) leave kv_wait out. Moving a request off a
              worker whose cache is full starts a second copy of its prefix in
              another cache: priced into choices, the wait cost chat 8% of its
              capacity at the TTFT SLO in the simulator and an overloaded closed-loop
              shape 6 points of hit rate (docs/studies/work-aware.md).

The price a choice compares (``Predictions.price``, ``cost``): the prediction stretched
for the worker's occupied decode slots, ``ttft * stretch(w)`` with ::

    stretch(w) = 1 / (1 - n / capacity), n (requests in flight, ours + others) counted
                 up to capacity - 1: 1 when idle or no capacity is known, the capacity
                 when full (the slot wait then prices the rest)

A request routed to a worker brings the later requests of its prefix there: they follow
the cache. The prediction prices only this request, which still finds a free slot;
priced alone, a heterogeneous fleet's new prefixes all went to its fast-prefilling
workers, whose decode slots then filled with the prefixes' later requests while the slow
workers had slots free, and the median request waited for a slot (retrieval questions on
2 of 8 workers at half speed: up to 3.7x SGLang's rule's median). Stretched as a queue's
response time is at utilisation n / capacity, cold work (long predicted times) goes
where slots are free and a hit (a few ms) stays on its busy holder. The predicted TTFT
itself (``ttft``, what is checked against first bytes) is not stretched.

Prefill engines run one prompt at a time in arrival order (vLLM and SGLang schedule
waiting prompts FIFO), so work ahead adds up; decode running beside prefill slows it,
which the learned rate absorbs at the load it was measured under. Per-request overhead
(scheduling, HTTP) is the learned line's intercept.
"""

from kvroute.routing.load.estimators import MIN_SAMPLES, WINDOW, MedianEstimator, ResistantLine
from kvroute.routing.load.model import (
    ENDS_SHARED,
    KV_FULL,
    PRIOR_DECODE_S,
    PRIOR_OUTPUT_TOKENS,
    PRIOR_OVERHEAD_S,
    PRIOR_PREFILL_TPS,
    EngineReading,
    LoadModel,
    Predictions,
    Ticket,
    WorkerWork,
    max_tokens_of,
)

__all__ = [
    "ENDS_SHARED",
    "KV_FULL",
    "MIN_SAMPLES",
    "PRIOR_DECODE_S",
    "PRIOR_OUTPUT_TOKENS",
    "PRIOR_OVERHEAD_S",
    "PRIOR_PREFILL_TPS",
    "WINDOW",
    "EngineReading",
    "LoadModel",
    "MedianEstimator",
    "Predictions",
    "ResistantLine",
    "Ticket",
    "WorkerWork",
    "max_tokens_of",
]
