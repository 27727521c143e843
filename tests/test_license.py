"""The LICENSE file is the licence pyproject.toml and Cargo.toml declare, in full."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_license_file_matches_the_declared_licence() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["license"]
    assert declared == cargo == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert re.match(r"\s*Apache License\s+Version 2\.0, January 2004", text)
    # The full text, not a stub: all nine sections and the end marker.
    for n, title in enumerate(
        (
            "Definitions",
            "Grant of Copyright License",
            "Grant of Patent License",
            "Redistribution",
            "Submission of Contributions",
            "Trademarks",
            "Disclaimer of Warranty",
            "Limitation of Liability",
            "Accepting Warranty or Additional Liability",
        ),
        start=1,
    ):
        assert f"{n}. {title}." in text
    assert "END OF TERMS AND CONDITIONS" in text
