"""Helpers for the image and audio recipe tests: tiny generated datasets, tiny configs, and a
`forgebench` subprocess runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]

# Tiny settings per recipe (top-level keys, sections): every code path in a few seconds.
TINY = {
    "image-classify": ("", "[image]\nsize = 32\nresize = \"none\"\n"),
    "image-detect": ("overlays = 2", "[image]\nsize = 32\nresize = \"none\"\n"),
    "image-segment": ("width = 4\npanels = 2", "[image]\nsize = 32\nresize = \"none\"\n"),
    "image-generate": ("", "[image]\nsize = 16\nresize = \"stretch\"\n"
                           "[diffusion]\nlevels = 16\nchannels = [8, 16]\nemb_dim = 16\n"
                           "[sample]\nper_class = 1\nsteps = 4\n"),
    "audio-generate": ("", "[diffusion]\nlevels = 8\nchannels = [4, 8]\nemb_dim = 16\n"
                           "[sample]\nsteps = 4\n"),
}


def make_shapes(root: Path, n: int = 40, size: int = 32) -> Path:
    from engine.data.generators.shapes import generate_shapes

    return generate_shapes(root / "shapes", n=n, size=size, seed=5)


def make_sfx(root: Path, n_per_class: int = 20) -> Path:
    from engine.data.generators.sfx import generate_sfx

    return generate_sfx(root / "sfx", n_per_class=n_per_class, seed=5)


def write_config(path: Path, recipe: str, data: Path, *, steps: int = 4, save_every: int = 2,
                 eval_every: int = 2, batch_size: int = 4, top: str | None = None,
                 sections: str | None = None) -> Path:
    tiny_top, tiny_sections = TINY[recipe]
    path.write_text(
        f'recipe = "{recipe}"\nseed = 1\nsteps = {steps}\nlog_every = 1\n'
        f"eval_every = {eval_every}\nsave_every = {save_every}\nkeep_last = 3\n"
        f"batch_size = {batch_size}\n{tiny_top if top is None else top}\n"
        f"[data]\ndir = \"{data}\"\n{tiny_sections if sections is None else sections}",
        encoding="utf-8")
    return path


def forgebench(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"forgebench {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


def same_tensors(a: Path, b: Path) -> None:
    """Bitwise equality of two safetensors files' tensors."""
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key].reshape(-1).view(torch.uint8),
                           tb[key].reshape(-1).view(torch.uint8)), key
