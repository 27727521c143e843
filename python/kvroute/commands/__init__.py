"""One module per CLI command; ``COMMANDS`` names them for ``kvroute.cli``."""

# command name -> (module under kvroute.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "run the router in front of SGLang or vLLM workers"),
    "sim-worker": ("sim_worker", "run a simulated inference server (GPU-free stand-in)"),
    "simulate": ("simulate", "simulate a fleet in virtual time and compare routing policies"),
    "demo": ("demo", "start 4 simulated workers and show cache_aware against round_robin"),
    "analyze": ("analyze", "measure prefix sharing in a trace: is cache-aware routing worth it?"),
    "doctor": ("doctor", "check a fleet before routing: engines, prefix caching, tokenizer"),
    "bench-index": ("bench_index", "benchmark the native prefix index"),
}
