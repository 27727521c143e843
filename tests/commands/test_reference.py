"""The configuration reference in docs/ is generated from the CLI and kept in step."""

from __future__ import annotations

from pathlib import Path

from kvroute.commands import _reference

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_configuration_page_is_what_the_cli_defines() -> None:
    page = (DOCS / "configuration.md").read_text()
    assert page == _reference.markdown(), (
        "docs/configuration.md is out of date: "
        "python -m kvroute.commands._reference > docs/configuration.md"
    )


def test_every_flag_of_every_command_is_in_the_reference() -> None:
    page = (DOCS / "configuration.md").read_text()
    missing = sorted(
        f for f in _reference.flags() if f"`{f}`" not in page and f not in ("-h", "--help")
    )
    assert missing == []
