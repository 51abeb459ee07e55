"""The sample workspace's finished example runs (packaging/make_examples.py).

Each shipped example is a completed run of a shipped config (the same resolved config but for
the settings the packer says it changed), portable (no file names the machine that made it),
and once installed it names its new folder: the data it records is the data there, its
checkpoint loads, and `forgebench resume` and `forgebench export` work from the new place.
The portable/relocate pair is also checked on a run made here, with twins that fail.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from lm_pretrain_support import TINY_CONFIG, make_corpus
from media_support import REPO, forgebench

from app.viewmodels import reports, transcripts
from app.viewmodels.masks import read_per_image, segmentation_evals
from app.viewmodels.runs import example_text, ledger_row, run_label
from app.viewmodels.workspace import BUNDLED_SAMPLE, Workspace, install_sample_workspace
from engine.cartridge.prefix import read_cartridge
from engine.config import load_config, recipe_module, validate_config
from engine.data.dataset import data_change
from engine.errors import ForgebenchError
from engine.rundir import EXAMPLE_FILE, WORKSPACE_TOKEN, RunDir, make_portable, relocate

SHIPPED = sorted(p for p in (BUNDLED_SAMPLE / "runs").glob("*/") if (p / "run.json").is_file())


def packer():
    spec = importlib.util.spec_from_file_location("make_examples",
                                                  REPO / "packaging" / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    return install_sample_workspace(tmp_path_factory.mktemp("home") / "sample-workspace")


def test_the_sample_workspace_ships_every_example_the_packer_makes():
    names = [p.name for p in SHIPPED]
    assert names == sorted(packer().EXAMPLES)
    assert {"shapes-generator", "where-demo", "sfx-generator", "sensor-alert"} <= set(names)


@pytest.mark.parametrize("run_dir", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_example_is_a_finished_run_of_its_shipped_config(run_dir):
    run = RunDir(run_dir)
    example = run.example
    assert example and example["name"] == run_dir.name
    assert example["shows"] == packer().EXAMPLES[run_dir.name].shows     # the app's tooltip
    assert run.status()["state"] == "completed"
    checkpoint = run.latest_checkpoint()
    # an example made as a user extends a run was resumed to a larger step target: run.json
    # keeps the config it started with, the status the target it reached
    target = example.get("extended_to") or run.manifest()["config"]["steps"]
    assert target > run.manifest()["config"]["steps"] or "extended_to" not in example
    assert checkpoint is not None and checkpoint.step == target == run.status()["target_steps"]
    # The recorded config is the shipped one with only the declared changes.
    shipped = load_config(BUNDLED_SAMPLE / example["config"]).model_dump(mode="json")
    wanted = packer().merged(shipped, example["changed_for_shipping"])
    recorded = run.manifest()["config"]
    assert recorded["base_dir"] == f"{WORKSPACE_TOKEN}/configs"
    # a section the schema gained after the run was made reads as its default (as on resume)
    recorded = validate_config(recorded).model_dump(mode="json")
    recorded.pop("base_dir")
    wanted.pop("base_dir")
    assert recorded == wanted
    # Portable: nothing names a folder of the machine that made it.
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl"):
            for folder in ("/tmp/", "/root/", "/home/", "/work/"):
                assert folder not in path.read_text(encoding="utf-8"), (path, folder)


@pytest.mark.parametrize("name", [p.name for p in SHIPPED])
def test_an_installed_example_reads_the_data_of_its_new_folder(installed, name):
    run = RunDir(installed / "runs" / name)
    for path in run.path.rglob("*.json*"):
        assert WORKSPACE_TOKEN not in path.read_text(encoding="utf-8"), path
    manifest = run.manifest()
    config = validate_config(manifest["config"])
    assert Path(config.base_dir) == installed.resolve() / "configs"
    # What resume compares: the data manifest computed in the new folder is the recorded one
    # (data_change: resume's own comparison, which reads a record made before dataset
    # versions covered dataset.json on its files).
    assert data_change(manifest["data"], recipe_module(config.recipe).data_manifest(config)) \
        is None
    # where the recorded data names a folder (a dataset; a cartridge's corpus is recorded by
    # its hashes only), it is the new one
    if WORKSPACE_TOKEN in json.dumps(RunDir(BUNDLED_SAMPLE / "runs" / name).manifest()["data"]):
        assert str(installed.resolve()) in json.dumps(manifest["data"])
    row = ledger_row(run.path)
    assert row.state == "completed" and row.example is not None
    assert run_label(run.path, row.recipe) == f"{name} ({row.recipe}, example)"
    assert "example run shipped with the sample workspace" in example_text(row.example)


def test_an_installed_example_resumes_from_its_new_folder(installed, tmp_path):
    # A copy of the installed example (so the module's install stays as shipped) one step on.
    run_dir = tmp_path / "where-demo"
    shutil.copytree(installed / "runs" / "where-demo", run_dir)
    steps = RunDir(run_dir).manifest()["config"]["steps"]
    # --allow-code-change: the example was made by the engine of its commit; code edited since
    # resumes with a recorded warning instead of a refusal.
    result = forgebench("resume", str(run_dir), "--steps", str(steps + 1), "--threads", "1",
                        "--allow-code-change", timeout=600)
    assert f"completed: step {steps + 1}/{steps + 1}" in result.stdout
    assert RunDir(run_dir).latest_checkpoint().step == steps + 1


def test_an_installed_generator_exports_a_verified_bundle(installed, tmp_path):
    out = tmp_path / "bundle"
    result = forgebench("export", str(installed / "runs" / "sfx-generator"), "--dtype", "f32",
                        "--out", str(out), timeout=600)
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True, result.stdout
    assert sorted(p.name for p in (out / "reference").iterdir())


def test_the_installed_segmenter_shows_its_predictions_worst_first(installed):
    """The Masks pane's view-model finds the example's val evaluation and reads it worst IoU
    first, every row with its four panels on disk; the mean matches the eval's summary."""
    run = installed / "runs" / "shapes-segmenter"
    (label, folder), = segmentation_evals([run])
    assert label == "shapes-segmenter · val-step-000400"
    rows = read_per_image(folder)
    ious = [row["iou"] for row in rows]
    assert ious == sorted(ious) and len(rows) > 1
    assert all(set(row["panels"]) == {"input", "probability", "prediction", "target"} and
               all(path.is_file() for path in row["panels"].values()) for row in rows)
    summary = json.loads((run / "evals" / "val-step-000400.json").read_text())
    assert sum(ious) / len(ious) == pytest.approx(summary["iou"])


def test_the_installed_recogniser_shows_its_transcripts_errors_and_all(installed):
    """The Transcripts pane's view-model finds the example and its val and test evaluations;
    every clip plays from the installed dataset, and the half-trained model's errors are
    there to see: the errors its clips show over their words are the evaluation's WER, which
    is neither 0 nor 1 (some words right, many wrong)."""
    run = installed / "runs" / "speech-commands"
    runs = Workspace(installed.resolve(), {}).run_dirs()
    assert transcripts.speech_runs(runs) == [("speech-commands", str(run.resolve()))]
    files = transcripts.transcript_files(run)
    assert [f.name for f in files] == ["test-step-000600-transcripts.jsonl",
                                       "val-step-000600-transcripts.jsonl"]
    for path in files:
        clips = transcripts.load_clips(path)
        assert clips and all(clip.path.is_file() for clip in clips)
        assert all(clip.path.is_relative_to(installed.resolve() / "datasets") for clip in clips)
        spoken = [clip for clip in clips if clip.reference]
        summary = json.loads(path.with_name(path.name.replace(transcripts.SUFFIX, ".json"))
                             .read_text())
        wer = sum(c.errors for c in spoken) / sum(len(c.reference.split()) for c in spoken)
        assert wer == pytest.approx(summary["wer"])
        assert 0 < wer < 1, wer


CARTRIDGE = "cartridge-guide"


def test_the_installed_cartridge_shows_its_comparison_and_names_its_base_portably(installed):
    """The cartridge example's held-out comparison reads in the Reports pane's view-model as
    the three conditions (its rows, the whole guide's tokens, a sentence that places the
    cartridge between them); its cartridge file is tied to the base run.json records, which is
    named as the shipped config names it (under ~, the model package's file), not by the
    folder of the machine that made it."""
    run = RunDir(installed / "runs" / CARTRIDGE)
    config = validate_config(run.manifest()["config"])
    checkpoint = run.latest_checkpoint()
    assert run.example["changed_for_shipping"]["cartridge"] == {"tokens": 128}
    assert config.cartridge.tokens == 128
    (path,) = (run.path / "evals").glob("cartridge-*.json")
    assert path.name == f"cartridge-{checkpoint.name}.json"
    comparison = reports.cartridge_comparison(reports.read_report(path))
    assert comparison.kv_prefix_tokens["cartridge"] == 128
    assert comparison.kv_prefix_tokens["whole document"] > 2000       # the guide, framed
    assert comparison.kv_prefix_tokens["no document"] == 0
    assert len(comparison.questions) == 6 + config.self_study.held_out
    assert "of the way" in comparison.headline() and "smaller" in comparison.headline()
    assert reports.comparison_summary(run.path) is not None       # the Runs pane's sentence
    base = run.manifest()["base_model"]
    assert base["path"] == config.model.gguf and base["path"].startswith("~/")
    meta = read_cartridge(checkpoint.path / "cartridge.safetensors").meta
    assert meta["base_sha256"] == base["sha256"] and meta["tokens"] == 128


@pytest.mark.realmodel
def test_the_shipped_cartridge_is_the_one_its_comparison_scored(installed, gemma_gguf):
    """With the base's package installed, the installed example loads as the recipe serves it
    (its base reading the shipped rows) and scores the first held-out question's reference
    answer as the shipped comparison recorded it (f32 numerics; a tolerance far above the last
    bits a CPU's kernels move); the bare base scores the no-document figure, and the two
    differ by more than the tolerance (the twin)."""
    import torch

    from engine.cartridge.self_study import answer_logprobs, prompt_ids
    from engine.fsutil import sha256_file
    from engine.recipes.lm_cartridge import load_trained

    run = RunDir(installed / "runs" / CARTRIDGE)
    assert sha256_file(gemma_gguf) == run.manifest()["base_model"]["sha256"]
    checkpoint = run.latest_checkpoint()
    record = json.loads((run.path / "evals" / f"cartridge-{checkpoint.name}.json").read_text())
    first = record["questions"][0]
    base, _ = load_trained(run, checkpoint, base_path=gemma_gguf)
    reference = base.tokenizer.encode(first["reference"], add_special=False,
                                      parse_special=False)
    prompt = prompt_ids(base, first["question"])

    def scored(model) -> float:
        with torch.no_grad():
            logp = answer_logprobs(model, prompt, reference)
        return float(logp.gather(-1, torch.tensor(reference)[:, None]).sum())

    with_rows, bare = scored(base.model), scored(base.model.base)
    assert with_rows == pytest.approx(first["cartridge"]["logprob"], abs=1e-2)
    assert bare == pytest.approx(first["no document"]["logprob"], abs=1e-2)
    assert abs(with_rows - bare) > 0.1


def tiny_run(workspace: Path) -> RunDir:
    """A two-step lm-pretrain run made in `workspace` (its config under configs/, its corpus
    under datasets/, both named relative to the config as the sample workspace does)."""
    (workspace / "configs").mkdir(parents=True)
    make_corpus(workspace / "datasets")
    config = workspace / "configs" / "tiny.toml"
    config.write_text(TINY_CONFIG.format(steps=2, save_every=1, top="", data="../datasets/corpus",
                                         tokenizer="byte", precision="auto"))
    forgebench("run", str(config), "--out", str(workspace / "runs" / "tiny"), "--threads", "1")
    return RunDir(workspace / "runs" / "tiny")


def moved_copy(made: RunDir, old: Path, new: Path) -> Path:
    """The workspace's data and the run copied to `new`; the old folder deleted."""
    shutil.copytree(old / "datasets", new / "datasets")
    (new / "configs").mkdir()
    shutil.copytree(made.path, new / "runs" / made.path.name)
    shutil.rmtree(old)                      # nothing of the old folder is left to read
    return new / "runs" / made.path.name


def test_a_portable_run_moved_to_another_workspace_resumes_there(tmp_path):
    made = tiny_run(tmp_path / "made")
    assert ledger_row(made.path).example is None                # the user's own run
    assert run_label(made.path, "lm-pretrain") == "tiny (lm-pretrain)"
    changed = make_portable(made.path, tmp_path / "made")
    assert "run.json" in changed and "invocations.jsonl" in changed
    assert str(tmp_path / "made") not in made.manifest_path.read_text()
    moved = moved_copy(made, tmp_path / "made", tmp_path / "moved")
    assert "run.json" in relocate(moved, tmp_path / "moved")
    result = forgebench("resume", str(moved), "--steps", "3", "--threads", "1")
    assert "completed: step 3/3" in result.stdout
    assert RunDir(moved).manifest()["data"]["dataset"] == \
        str((tmp_path / "moved" / "datasets" / "corpus").resolve())


def test_twin_an_unrelocated_run_is_refused_with_the_way_to_relocate_it(tmp_path):
    made = tiny_run(tmp_path / "made")
    make_portable(made.path, tmp_path / "made")
    moved = moved_copy(made, tmp_path / "made", tmp_path / "moved")    # {workspace} kept
    for command in (("resume", str(moved), "--steps", "3", "--threads", "1"),
                    ("eval", str(moved))):
        result = forgebench(*command, check=False)
        assert result.returncode == 2, result.stderr
        assert "a shipped example run whose paths are still written {workspace}" in result.stderr
        assert "generate one" not in result.stderr
    hint = result.stderr.split("hint: ", 1)[1].strip()
    assert "Open sample workspace" in hint
    # The hint's own command relocates the copy into the workspace it sits in, and it resumes;
    # a second relocation has nothing to do.
    relocating = shlex.split(hint[hint.index("forgebench relocate"):])
    assert relocating[:2] == ["forgebench", "relocate"] and len(relocating) == 3
    assert "relocated into" in forgebench(*relocating[1:]).stdout
    assert WORKSPACE_TOKEN not in (moved / "run.json").read_text()
    assert "nothing to relocate" in forgebench(*relocating[1:]).stdout
    result = forgebench("resume", str(moved), "--steps", "3", "--threads", "1")
    assert "completed: step 3/3" in result.stdout


def test_relocate_refuses_a_run_outside_a_workspace_or_a_missing_workspace(tmp_path):
    made = tiny_run(tmp_path / "made")
    loose = tmp_path / "loose-run"
    shutil.copytree(made.path, loose)
    result = forgebench("relocate", str(loose), check=False)
    assert result.returncode == 2 and "name it: forgebench relocate RUN WORKSPACE" in result.stderr
    result = forgebench("relocate", str(loose), str(tmp_path / "nowhere"), check=False)
    assert result.returncode == 2 and "no such workspace folder" in result.stderr


def test_make_portable_refuses_a_file_it_cannot_rewrite(tmp_path):
    run_dir = tmp_path / "ws" / "runs" / "r"
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"base_dir": str(tmp_path / "ws")}))
    # A checkpoint file's SHA-256 is recorded, so it is never rewritten: naming the folder
    # there makes the run unshippable.
    (run_dir / "checkpoints" / "step-000001" / "meta.json").write_text(str(tmp_path / "ws"))
    with pytest.raises(ForgebenchError, match="still names the workspace folder"):
        make_portable(run_dir, tmp_path / "ws")


def test_an_example_marker_marks_even_when_damaged(tmp_path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    assert run.example is None
    (run.path / EXAMPLE_FILE).write_text("{not json")
    assert run.example == {}
