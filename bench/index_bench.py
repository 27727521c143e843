"""Benchmark of the native prefix index from Python (same as ``kvroute bench-index``).

Usage: python bench/index_bench.py [--requests N] [--workers 10 50 100 500]
"""

import sys

from kvroute.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench-index", *sys.argv[1:]]))
