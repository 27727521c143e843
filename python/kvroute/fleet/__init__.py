"""The fleet as the router sees it: the worker registry (load reservations, health
state, circuit breaker), active health checks, the load engines report, and the state
router replicas share through Redis (``shared``, ``--state-store``)."""
