"""Command-line entry point: ``kvroute <command> ...``.

Each command lives in ``kvroute.commands.<name>`` and exposes two functions:
``configure(parser)`` adds its flags, ``run(args) -> int`` does the work. Modules are
imported only for the command that runs, so ``kvroute --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvroute.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description=(
            "Cache-aware router for LLM inference fleets: sends each request to the "
            "replica most likely to hold its prompt prefix in KV cache, unless that "
            "would overload it."
        ),
    )
    from kvroute import __version__

    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        # Only the chosen command's flags are needed, but --help on a command must list them.
        if _wants(name):
            _load(module_name).configure(p)
    return parser


def _wants(name: str) -> bool:
    """True when ``name`` is the command on the command line (its first positional)."""
    first = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    return first == name


def _load(module_name: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"kvroute.commands.{module_name}")


def main(argv: Sequence[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    result: int = _load(args._module).run(args)
    return result
