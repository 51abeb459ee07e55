"""`forgebench export` of image-generate and audio-generate runs: a generator bundle that loads
from its own files and is verified against the checkpoint (engine/export/generator_bundle.py).

Real tiny runs are trained by the engine; the bundle's reference outputs are redrawn from the
bundle alone and compared with the files; a bundle whose weights were altered no longer
reproduces them (the twin that shows the check can fail)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from app_part2_support import media_workspace
from media_support import forgebench
from PIL import Image
from safetensors.torch import load_file, save_file

from engine.export.generator_bundle import draw, load_bundle


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny image and audio runs the app tests share (trained once per session)."""
    workspace = media_workspace(tmp_path_factory)
    return {"image-generate": workspace.runs_dir / "image",
            "audio-generate": workspace.runs_dir / "audio"}


def _sums_hold(folder) -> None:
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


def test_an_image_generator_exports_as_a_verified_bundle(runs, tmp_path):
    out = tmp_path / "image-f32"
    done = forgebench("export", str(runs["image-generate"]), "--dtype", "f32", "--out", str(out))
    assert "VERIFIED" in done.stdout
    report = json.loads((out / "report.json").read_text())
    bundle = report["stages"][1]
    assert report["passed"] and bundle["identical"] and bundle["weights_identical"]
    assert bundle["max_abs_diff"] == 0.0
    _sums_hold(out)
    card = (out / "model_card.md").read_text()
    assert str(tmp_path) not in card and str(runs["image-generate"].parent) not in card
    # The bundle alone redraws its reference images (same seed, same weights).
    spec, model = load_bundle(out)
    pixels = ((draw(model, spec).permute(0, 2, 3, 1) + 1) / 2 * 255).round().byte().numpy()
    for k, label in enumerate(spec["classes"]):
        drawn = np.asarray(Image.open(out / "reference" / f"{label}.png").convert("RGB"))
        assert np.array_equal(drawn, pixels[k])
    # Twin: altered weights no longer reproduce them.
    tensors = load_file(str(out / "model.safetensors"))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, str(out / "model.safetensors"))
    spec, altered = load_bundle(out)
    moved = ((draw(altered, spec).permute(0, 2, 3, 1) + 1) / 2 * 255).round().byte().numpy()
    assert not np.array_equal(moved, pixels)


def test_an_audio_generator_exports_as_f16_with_its_loss_shown(runs, tmp_path):
    out = tmp_path / "audio-f16"
    forgebench("export", str(runs["audio-generate"]), "--dtype", "f16", "--out", str(out))
    report = json.loads((out / "report.json").read_text())
    bundle = report["stages"][1]
    assert all(t.dtype == torch.float16 for t in load_file(str(out / "model.safetensors"))
               .values())
    assert not bundle["weights_identical"]      # f16 rounds them, and the report says so
    assert report["passed"] == (bundle["identical"] or bundle["psnr_db"] >= 30)
    spec = json.loads((out / "model.json").read_text())
    assert sorted(p.name for p in (out / "reference").iterdir()) == \
        sorted(f"{c}.wav" for c in spec["classes"])
    _sums_hold(out)


def test_a_generator_refuses_a_gguf_quantization(runs, tmp_path):
    done = forgebench("export", str(runs["audio-generate"]), "--dtype", "q8_0", "--out",
                      str(tmp_path / "q"), check=False)
    assert done.returncode == 2 and "error:" in done.stderr and "f32 or f16" in done.stderr
    assert not (tmp_path / "q").exists()
