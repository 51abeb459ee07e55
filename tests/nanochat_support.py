"""What the nanochat tests share with the scripts that made their reference data
(tests/data/nanochat/make_goldens.py runs in the reference's own venv, without the engine, so
the tests load it from its file rather than the other way round)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DATA = Path(__file__).parent / "data" / "nanochat"


def goldens_script():
    spec = importlib.util.spec_from_file_location("make_goldens", DATA / "make_goldens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_kind() -> str:
    """The kind of CPU the reference data records (vendor and torch's vector width)."""
    return goldens_script().cpu_kind()
