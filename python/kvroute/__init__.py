"""kvroute: a cache-aware router for fleets of LLM inference servers.

The prefix index (``PrefixIndex``) is implemented in Rust (``kvroute._native``);
the HTTP router, policies, simulated workers and benchmarks are Python.
"""

from kvroute._native import BlockIndex, PrefixIndex, UnknownParentError

__all__ = ["BlockIndex", "PrefixIndex", "UnknownParentError", "__version__"]
__version__ = "0.1.0"
