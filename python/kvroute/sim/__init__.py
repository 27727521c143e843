"""GPU-free stand-ins for an inference fleet.

* ``cache``: a block-granular prefix cache with LRU eviction (vLLM's automatic prefix
  caching, in miniature), shared by the HTTP worker and the fleet simulator;
* ``cost``: the timing model (prefill, decode, batching) both of them use;
* ``engine`` / ``worker`` / ``events``: ``kvroute sim-worker``, an HTTP server speaking
  the SGLang and OpenAI/vLLM APIs, optionally publishing vLLM-format KV events;
* ``textcodec``: token IDs as text (one character per token) for text-only routers;
* ``workloads``: deterministic request generators (shared prefix, multi-turn, Mooncake);
* ``fleet``: a discrete-event simulation of a whole fleet behind the real policies;
* ``report``: the metrics and Markdown table shared by the simulator and the benchmark.
"""
