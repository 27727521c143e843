"""The fleet as the router sees it: the worker registry (load reservations, health
state, circuit breaker), active health checks, and the load engines report."""
