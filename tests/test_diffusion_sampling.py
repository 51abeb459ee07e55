"""`forgebench sample` for the image and audio generators: files, sidecars, events, class
checks and clean cancellation by SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import soundfile
from media_support import REPO, forgebench, make_sfx, make_shapes, write_config

from engine.config import load_config
from engine.jobs import execute, start_run
from engine.rundir import RunDir


def tiny_run(tmp_path, recipe, dataset, sections=None):
    config_path = write_config(tmp_path / f"{recipe}.toml", recipe, dataset, steps=2,
                               eval_every=0, save_every=0, sections=sections)
    run = start_run(load_config(config_path), tmp_path / recipe, ["test"], threads=1)
    execute(run, load_config(config_path), None, threads=1, progress=False)
    return RunDir(run.path)


def test_image_samples_have_sidecars_and_neighbours(tmp_path):
    run = tiny_run(tmp_path, "image-generate", make_shapes(tmp_path, n=20))
    grid = run.path / "samples/step-000002/grid.png"
    assert grid.is_file() and json.loads(grid.with_suffix(".json").read_text())["seed"] == 17
    result = forgebench("sample", str(run.path), "--class", "circle", "--n", "2", "--seed", "3",
                        "--cfg", "2", "--steps", "4")
    paths = result.stdout.split()
    assert [os.path.basename(p) for p in paths] == ["circle-seed3-000.png", "circle-seed3-001.png"]
    sidecar = json.loads(open(paths[0].replace(".png", ".json")).read())
    assert sidecar["class"] == "circle" and sidecar["seed"] == 3
    assert sidecar["settings"]["cfg"] == 2.0 and sidecar["settings"]["steps"] == 4
    assert sidecar["checkpoint"] == "step-000002" and sidecar["model"]["family"] == "DenoisingUNet"
    nearest = sidecar["nearest_training"]
    assert nearest["pixel"]["id"].startswith("shape-")
    # unit histograms of non-negative counts: 1 - cosine lies in [0, 1]; a sample after two
    # steps is no copy of a training image (0 would be one)
    assert 0.0 < nearest["feature"]["cosine_distance"] <= 1.0
    assert nearest["feature"]["id"].startswith("shape-")
    written = [e for e in run.events() if e["kind"] == "sample_written"]
    assert len(written) == 3  # the grid and the two samples
    # Same seed, same settings: the same pixels.
    again = forgebench("sample", str(run.path), "--class", "circle", "--n", "2", "--seed", "3",
                       "--cfg", "2", "--steps", "4", "--out", str(tmp_path / "again"))
    assert open(paths[1], "rb").read() == open(again.stdout.split()[1], "rb").read()
    bad = forgebench("sample", str(run.path), "--class", "hexagon", check=False)
    assert bad.returncode == 2 and "hexagon" in bad.stderr and "circle" in bad.stderr


def test_audio_samples_are_pcm16_with_integrity_flags(tmp_path):
    run = tiny_run(tmp_path, "audio-generate", make_sfx(tmp_path, n_per_class=20))
    result = forgebench("sample", str(run.path), "--class", "ping", "--n", "1", "--seed", "5",
                        "--steps", "4", "--cfg", "1.5")
    (path,) = result.stdout.split()
    info = soundfile.info(path)
    assert (info.samplerate, info.channels, info.subtype, info.frames) == (16000, 1, "PCM_16", 8192)
    sidecar = json.loads(open(path.replace(".wav", ".json")).read())
    assert {k: sidecar[k] for k in ("class", "seed", "cfg", "steps", "checkpoint")} == {
        "class": "ping", "seed": 5, "cfg": 1.5, "steps": 4, "checkpoint": "step-000002"}
    assert set(sidecar["integrity"]["flags"]) <= {"clipping", "dc_offset", "silence", "edge_click"}
    assert sidecar["integrity"]["peak"] == pytest.approx(
        float(np.abs(soundfile.read(path)[0]).max()), abs=1e-3)
    assert sidecar["nearest_training"]["log_stft"]["id"].startswith(("thump", "ping", "hiss"))
    assert sidecar["settings"]["peak_normalized"] is False
    # Written for listening: a two-step model's noise has its mean removed and its ends faded,
    # so it neither sits off zero nor clicks; the model's own output's flags are kept beside.
    wave = soundfile.read(path)[0]
    assert not {"dc_offset", "edge_click"} & set(sidecar["integrity"]["flags"])
    assert abs(wave.mean()) < 1e-3 and np.abs(wave[[0, -1]]).max() < 1e-3
    assert sidecar["settings"]["mean_removed"] and sidecar["settings"]["edge_fade_s"] == 0.005
    assert set(sidecar["integrity_model_output"]["flags"]) <= {
        "clipping", "dc_offset", "silence", "edge_click"}


def test_sampling_is_cancelled_cleanly_by_sigterm(tmp_path):
    sections = ("[image]\nsize = 16\nresize = \"stretch\"\n[diffusion]\nlevels = 20000\n"
                "channels = [4, 8]\nemb_dim = 16\n[sample]\nper_class = 1\nsteps = 2\n")
    run = tiny_run(tmp_path, "image-generate", make_shapes(tmp_path, n=20), sections)
    out = tmp_path / "cancelled"
    proc = subprocess.Popen([sys.executable, "-m", "engine", "sample", str(run.path), "--n", "1",
                             "--out", str(out)], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    seen = ""
    while not re.search(r"\| *[1-9]\d*/\d+ \[", seen):   # a sampler step is done: mid-sampling
        seen += proc.stderr.read(1)
        assert proc.poll() is None, seen
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    assert not out.exists() or not any(out.iterdir())
