"""The engine's CLI as the benches call it: `forgebench ARGS` in a fresh `python -m engine`
subprocess of this checkout, its stdout returned; a failure ends the bench with the command
and the tail of its stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def forgebench(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"forgebench {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout
