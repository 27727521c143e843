"""The real-vLLM slow suites' shared start: ``bench/engine/serve.py`` loaded as a module
(it lives outside the package), or the whole test module skipped with the reason when
the engine or the tiny model is not installed (docs/real-engine.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = "kvroute_bench_serve"


def engine_or_skip() -> ModuleType:
    """``bench/engine/serve.py`` as a module; skips the calling test module without vLLM."""
    mod = sys.modules.get(NAME)
    if mod is None:
        spec = importlib.util.spec_from_file_location(NAME, ROOT / "bench/engine/serve.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    missing = mod.engine_available()
    if missing:
        pytest.skip(f"real vLLM engine not installed: {missing}", allow_module_level=True)
    return mod
