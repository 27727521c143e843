"""``python -m kvroute`` is the same as the ``kvroute`` console script."""

from kvroute.cli import main

raise SystemExit(main())
