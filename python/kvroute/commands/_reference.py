"""The configuration reference (``docs/configuration.md``), generated from the CLI's own
argparse definitions so it cannot drift from ``--help``.

Regenerate with ``python -m kvroute.commands._reference > docs/configuration.md``; a test
fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import argparse
import importlib

from kvroute.commands import COMMANDS

HEADER = """# Configuration reference

Every command's flags, generated from the CLI's own definitions
(`python -m kvroute.commands._reference > docs/configuration.md`); `kvroute COMMAND --help`
prints the same. Defaults are shown where a flag has one.
"""


def _default(action: argparse.Action) -> str:
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return ""
    if isinstance(action.default, list | tuple):
        return " ".join(str(v) for v in action.default) if action.default else ""
    return str(action.default)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar
    if metavar is None and action.choices is not None:
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    if metavar is None:
        metavar = action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    suffix = " ..." if action.nargs in ("*", "+") else ""
    return f"{names} `{metavar}{suffix}`"


def command_parser(name: str) -> argparse.ArgumentParser:
    module_name, help_text = COMMANDS[name]
    p = argparse.ArgumentParser(prog=f"kvroute {name}", description=help_text)
    importlib.import_module(f"kvroute.commands.{module_name}").configure(p)
    return p


def markdown() -> str:
    out = [HEADER]
    for name, (_, help_text) in COMMANDS.items():
        p = command_parser(name)
        out.append(f"## `kvroute {name}`\n\n{help_text[0].upper()}{help_text[1:]}.\n")
        for group in p._action_groups:
            actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
            positionals = [a for a in group._group_actions if not a.option_strings]
            if not actions and not positionals:
                continue
            title = group.title or "options"
            if title in ("options", "optional arguments"):
                title = "options"
            out.append(f"### {title}\n")
            out.append("| flag | default | meaning |\n|---|---|---|")
            for a in positionals:
                out.append(f"| `{a.metavar or a.dest}` (positional) | | {_cell(a.help or '')} |")
            for a in actions:
                default = _default(a)
                flag = _flag(a).replace("|", "\\|")
                shown = f"`{default}`" if default else ""
                out.append(f"| {flag} | {shown} | {_cell(a.help or '')} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def flags() -> set[str]:
    """Every option string of every command."""
    found: set[str] = set()
    for name in COMMANDS:
        for a in command_parser(name)._actions:
            found.update(a.option_strings)
    return found


if __name__ == "__main__":
    print(markdown(), end="")
