"""``kvroute`` whose shared-state store publishes nothing (for ``shared_state_http_cpu.py
--silent-store`` only, never a deployment).

The store connects, beats and reads the other routers' streams as usual; the routing
decisions and load changes it would write are dropped where they are queued, so no
entry is packed, no flush is scheduled and nothing is sent. Against a router whose store
publishes, over the same seconds, the difference is what publishing costs end to end.

Usage: python bench/silent_store_serve.py serve --state-store URL ...
"""

from __future__ import annotations

import sys

from kvroute.cli import main
from kvroute.fleet.shared import publishing


def _dropped(self: publishing.Publisher) -> None:
    self._buf.clear()


publishing.Publisher._queued = _dropped  # type: ignore[method-assign]
publishing.Publisher._load_changed = lambda self: None  # type: ignore[method-assign]
publishing.Publisher.flush_lingering = lambda self: None  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
