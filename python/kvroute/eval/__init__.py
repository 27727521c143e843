"""Measuring routers: the routing-quality harness, the load generator, process helpers
(servers on loopback, stopped by PID) and the peer routers (SGLang's, vLLM's)."""
