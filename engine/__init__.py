"""Forgebench training engine.

Importable without torch: the app reads run directories, config schemas and datasets through
this package. Modules that need torch import it themselves.
"""

import os

__version__ = "0.1.0"

# Idle OpenMP threads sleep instead of spinning (read when torch loads, so set before it does).
# libgomp's default spins ~300k iterations at every barrier: on a machine shared with other
# processes a spinning thread holds a core its partner needs, and a 2-thread LoRA step of the
# pirate demo measured 146-265 s wall instead of 2.6-8 s passive (interleaved, load 25 on 2
# cores). A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
