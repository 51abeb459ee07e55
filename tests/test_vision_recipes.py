"""Every image/audio recipe end to end on tiny generated data: a real `forgebench run` stopped
by SIGTERM after step 2 and resumed to step 4 matches an uninterrupted run bit for bit; then
eval and sample through the CLI."""

from __future__ import annotations

import pytest
from media_support import forgebench, make_sfx, make_shapes, same_tensors, write_config

from engine.config import load_config, recipe_module
from engine.fsutil import read_json
from engine.jobs import execute, start_run
from engine.rundir import RunDir

RECIPES = ["image-classify", "image-detect", "image-segment", "image-generate", "audio-generate"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    return {"shapes": make_shapes(root), "sfx": make_sfx(root)}


def train_series(run: RunDir) -> dict:
    return {m["step"]: (m["loss"], m["grad_norm"], m["lr"]) for m in run.metrics()
            if m.get("split") == "train"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_stop_resume_is_exact_and_eval_works(recipe, data, tmp_path):
    dataset = data["sfx"] if recipe.startswith("audio") else data["shapes"]
    config_path = write_config(tmp_path / "c.toml", recipe, dataset)

    # Reference: uninterrupted, in this process (same machine, same thread count).
    reference = start_run(load_config(config_path), tmp_path / "ref", ["test"], threads=1)
    execute(reference, load_config(config_path), None, threads=1, progress=False)

    # Real process, real SIGTERM after step 2, then a real resume.
    out = tmp_path / "run"
    forgebench("run", str(config_path), "--out", str(out), "--threads", "1",
               "--stop-after-step", "1")
    run = RunDir(out)
    assert run.status()["state"] == "stopped" and run.latest_checkpoint().step == 1
    forgebench("resume", str(out))
    assert run.status()["state"] == "completed"

    assert sorted(train_series(run)) == [1, 2, 3, 4]
    assert train_series(run) == train_series(reference)
    same_tensors(run.path / "checkpoints/step-000004/model.safetensors",
                 reference.path / "checkpoints/step-000004/model.safetensors")
    same_tensors(run.path / "checkpoints/step-000004/optimizer.safetensors",
                 reference.path / "checkpoints/step-000004/optimizer.safetensors")
    assert [m["invocation"] for m in run.metrics() if m.get("split") == "train"] == [1, 2, 2, 2]
    meta = read_json(run.path / "checkpoints/step-000004/meta.json")
    assert meta["recipe"] == recipe and meta["classes"]

    report = recipe_module(recipe).evaluate(run, run.checkpoint("latest"), "test")
    assert report["split"] == "test" and report["step"] == 4
    assert read_json(out / "evals" / "test-step-000004.json")["loss"] == report["loss"]
