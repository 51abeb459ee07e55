"""Qt-free view-model tests: workspaces, settings, run series and ledger, recipe forms, mask
editing, dataset tables. None of these import Qt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_app_support import make_workspace, write_run

from app.viewmodels import jobs
from app.viewmodels.datasets import DatasetTable
from app.viewmodels.forms import RecipeForm
from app.viewmodels.masks import MaskEditor, count_regions, holes, read_mask, save_mask_version
from app.viewmodels.runs import JsonlTail, RunSeries, ema, failure_report, ledger_row, write_notes
from app.viewmodels.workspace import Settings, Workspace
from engine.config import load_config
from engine.data.dataset import load_dataset
from engine.data.media import box_from_mask
from engine.errors import ForgebenchError
from engine.eval.masks import boundary

REPO = Path(__file__).resolve().parents[1]


def test_app_never_imports_torch_or_needs_audio():
    code = ("import sys, app.main, app.screenshots, app.views.main_window, "
            "app.viewmodels.runs, app.viewmodels.forms, app.viewmodels.masks, "
            "app.viewmodels.datasets, app.viewmodels.jobs; "
            "print('torch' in sys.modules, 'sounddevice' in sys.modules)")
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_viewmodels_do_not_import_qt():
    code = ("import sys, app.viewmodels.runs, app.viewmodels.forms, app.viewmodels.masks, "
            "app.viewmodels.datasets, app.viewmodels.jobs, app.viewmodels.workspace; "
            "print(any(m.startswith('PySide6') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- workspace and settings --------------------------------------------------------------
def test_workspace_create_open_and_refusals(tmp_path):
    ws = Workspace.create(tmp_path / "ws", name="mine")
    assert (ws.root / "workspace.json").is_file()
    assert all((ws.root / d).is_dir() for d in ("datasets", "runs", "exports", "ratings"))
    again = Workspace.open(tmp_path / "ws")
    assert again.name == "mine" and again.root == ws.root
    with pytest.raises(ForgebenchError, match="already exists"):
        Workspace.create(tmp_path / "ws")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("x")
    with pytest.raises(ForgebenchError, match="not empty"):
        Workspace.create(tmp_path / "busy")
    with pytest.raises(ForgebenchError, match="not a workspace") as exc:
        Workspace.open(tmp_path / "busy")
    assert "busy" in exc.value.render()
    (tmp_path / "ws").rename(tmp_path / "moved")
    with pytest.raises(ForgebenchError, match="missing") as exc:
        Workspace.open(tmp_path / "ws")
    assert "open another workspace" in exc.value.render()


def test_settings_keep_recent_workspaces(tmp_path):
    settings = Settings(tmp_path / "cfg" / "settings.json")
    assert settings.first_launch
    for i in range(12):
        settings.add_recent(tmp_path / f"w{i}")
    settings.add_recent(tmp_path / "w3")
    reread = Settings(tmp_path / "cfg" / "settings.json")
    assert reread.recent[0] == str((tmp_path / "w3").resolve())
    assert len(reread.recent) == 10 and len(set(reread.recent)) == 10
    reread.forget(reread.recent[0])
    assert str((tmp_path / "w3").resolve()) not in Settings(reread.path).recent
    (tmp_path / "bad.json").write_text("{not json")
    assert Settings(tmp_path / "bad.json").recent == []  # a damaged file never blocks the app


def test_new_run_dir_names_are_unique(tmp_path):
    ws = Workspace.create(tmp_path / "ws")
    first = ws.new_run_dir("tiny")
    first.mkdir()
    assert ws.new_run_dir("tiny") != first


# -- runs --------------------------------------------------------------------------------
def test_jsonl_tail_returns_only_complete_new_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == []  # missing file
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3')
    assert [r["step"] for r in tail.read_new()] == [1, 2]
    assert tail.read_new() == []
    with open(path, "a") as handle:
        handle.write('}\nnot json\n{"step": 4}\n')
    assert [r["step"] for r in tail.read_new()] == [3, 4]
    assert tail.bad_lines == 1
    path.write_text('{"step": 9}\n')  # replaced by a shorter file: read again from the start
    assert [r["step"] for r in tail.read_new()] == [9]


def test_ema_matches_hand_computation():
    # w = 0.5: running 0.5, 1.25, 2.125; debiased by 1 - 0.5^n = 0.5, 0.75, 0.875.
    assert ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert ema([1.0, 2.0], 0.0) == [1.0, 2.0]
    smoothed = ema([1.0, float("nan"), 3.0], 0.5)
    assert smoothed[0] == 1.0 and smoothed[1] != smoothed[1]
    assert smoothed[2] == pytest.approx((0.5 * 0.5 + 1.5) / 0.75)


def test_run_series_follows_a_run_incrementally(tmp_path):
    run = write_run(tmp_path / "r", steps=10, resume_at=6)
    series = RunSeries(run.path)
    assert series.poll() is True
    xs, ys = series.xy("loss")
    assert xs == list(range(1, 11)) and len(ys) == 10
    assert series.xy("loss", split="val")[0] == [5, 10]
    assert series.checkpoint_steps == [5, 10]
    assert series.invocation_steps == [0, 5]
    assert series.clip_threshold == 1.0
    # grad_norm 2/step exceeds the clip threshold 1.0 at step 1 only (2/2 = 1 is not above).
    assert series.clipped_points() == ([1], [2.0])
    assert series.xy("loss", x="time")[0][:2] == [0.0, 1.0]
    assert series.poll() is False  # nothing new
    run.log_metric({"step": 11, "split": "train", "loss": 0.5})
    assert series.poll() is True
    assert series.xy("loss")[0][-1] == 11


def test_ledger_rows_and_notes(tmp_path):
    run = write_run(tmp_path / "r", steps=10)
    write_notes(run.path, question="does warmup 5 beat 20?", notes="baseline")
    row = ledger_row(run.path)
    assert (row.state, row.step, row.target_steps) == ("stopped", 10, 10)
    assert row.question == "does warmup 5 beat 20?" and row.notes == "baseline"
    best = min(3.0 * np.exp(-s / 6) + 1.2 for s in (5, 10))
    assert row.best_metric == f"val loss {best:.4g} @ 10"
    assert row.data_version.startswith("records #")
    assert json.loads((run.path / "run.json").read_text())["recipe"] == "lm-pretrain"


def test_failed_run_reports_stage_error_and_traceback(tmp_path):
    run = write_run(tmp_path / "r", steps=3, state="running")
    run.log_event("error", stage="backward", step=3, message="RuntimeError: boom",
                  traceback="Traceback (most recent call last):\n  File \"x.py\"\n"
                            "RuntimeError: boom")
    run.set_status("failed", stage="backward", error="RuntimeError: boom", pid=None)
    row = ledger_row(run.path)
    assert (row.state, row.stage, row.error) == ("failed", "backward", "RuntimeError: boom")
    report = failure_report(run.path)
    assert "failed during backward: RuntimeError: boom" in report
    assert "Traceback (most recent call last)" in report


def test_a_job_that_vanished_is_failed_not_hung(tmp_path):
    run = write_run(tmp_path / "r", steps=3)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run.set_status("running", pid=dead.pid)
    row = ledger_row(run.path)
    assert row.state == "failed" and "gone" in row.error
    assert "gone" in failure_report(run.path)


def test_job_queue_persists_and_releases_one_at_a_time(tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0)
    form = RecipeForm.from_file(ws.configs_dir / "tiny.toml")
    a = jobs.prepare_run(ws, form, "tiny")
    b = jobs.prepare_run(ws, form, "tiny")
    assert a.out != b.out and a.config.is_file()
    queue = jobs.JobQueue(ws)
    queue.push(a)
    queue.push(b)
    again = jobs.JobQueue(ws)
    assert [p.out for p in again.items] == [a.out, b.out]
    assert again.pop_ready(any_active=True) is None
    assert again.pop_ready(any_active=False) == a
    assert [p.out for p in jobs.JobQueue(ws).items] == [b.out]
    argv = a.argv()
    assert argv[-4:] == ["run", str(a.config), "--out", str(a.out)]


# -- recipe forms ------------------------------------------------------------------------
def test_recipe_form_from_schema_defaults_and_inline_errors(tmp_path):
    (tmp_path / "datasets" / "records").mkdir(parents=True)
    form = RecipeForm("lm-pretrain", base_dir=str(tmp_path / "configs"))
    names = [f.name for f in form.fields]
    assert "data.dir" in names and "optim.lr" in names and "model.dim" in names
    assert form.text["optim.lr"] == "0.003" and form.text["model.dim"] == "128"
    assert form.errors == {"data.dir": "required"} and not form.valid
    # Paths are checked where the engine will look: relative to the config's folder.
    form.set_text("data.dir", "datasets/records")
    assert form.errors["data.dir"].startswith(
        f"not found: {tmp_path / 'configs' / 'datasets' / 'records'}")
    assert "../datasets/records" in form.errors["data.dir"]
    form.set_text("data.dir", "../datasets/records")
    assert form.valid
    form.set_text("optim.lr", "-1")
    assert "greater than 0" in form.errors["optim.lr"]
    form.set_text("steps", "ten")
    assert form.errors["steps"] == "expected a whole number"
    form.set_text("optim.lr", "0.01")
    form.set_text("steps", "7")
    assert form.valid
    form.set_text("model.n_heads", "3")  # 128 is not divisible by 3: the schema's own check
    assert not form.valid and "not divisible" in (form.errors.get("model.n_heads")
                                                  or form.general_error)
    with pytest.raises(ForgebenchError, match="invalid fields"):
        form.write_toml(tmp_path / "bad.toml")
    assert not (tmp_path / "bad.toml").exists()
    assert form.spec("optim.schedule").choices == ("cosine", "constant")


def test_recipe_form_round_trips_through_the_engine_loader(tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=0, steps=11)
    form = RecipeForm.from_file(ws.configs_dir / "tiny.toml")
    assert form.valid, form.errors
    form.set_text("optim.lr", "0.005")
    # One prompt per line: a comma stays inside its prompt.
    form.set_text("sample.prompts", "Record item, with a comma\nAnother\n\n")
    written = form.write_toml(tmp_path / "out.toml")
    config = load_config(written)
    assert config.steps == 11 and config.optim.lr == 0.005 and config.model.dim == 16
    assert config.sample.prompts == ["Record item, with a comma", "Another"]
    assert RecipeForm.from_file(written).text["sample.prompts"] == \
        "Record item, with a comma\nAnother"
    # base_dir is kept, so the relative data path still resolves against the configs folder.
    assert config.resolve_path(config.data.dir) == (ws.datasets_dir / "records").resolve()


def test_recipe_form_takes_the_lm_sft_modes_and_tool_data(tmp_path):
    """The new-run form of lm-sft offers mode "cpt" with its control text (a checked path) and
    the tool-conversation data shape, and what it writes loads as the engine reads it."""
    from engine.data.generators.catalog import generate_cpt_corpus, generate_tool_conversations

    generate_cpt_corpus(tmp_path / "datasets" / "cpt", n=5)
    generate_tool_conversations(tmp_path / "datasets" / "tools", n=4)
    (tmp_path / "base.gguf").write_bytes(b"GGUF")
    form = RecipeForm("lm-sft", base_dir=str(tmp_path))
    assert form.spec("mode").choices == ("sft", "cpt")
    assert "tools" in form.spec("data.format").choices
    form.set_text("model.gguf", "base.gguf")
    form.set_text("data.path", "datasets/cpt")
    form.set_text("mode", "cpt")
    form.set_text("data.control_path", "datasets/cpt/missing.txt")
    assert form.errors["data.control_path"].startswith("not found: ")
    form.set_text("data.control_path", "datasets/cpt/control.txt")
    assert form.valid, form.errors
    config = load_config(form.write_toml(tmp_path / "cpt.toml"))
    assert config.mode == "cpt" and config.data.control_path == "datasets/cpt/control.txt"
    form.set_text("data.format", "messages")       # the schema's own cross-field check
    assert not form.valid and "reads raw documents" in (form.general_error or str(form.errors))
    tools = RecipeForm.from_file(REPO / "resources" / "configs" / "lm-sft-tools.toml")
    assert tools.text["data.format"] == "tools" and tools.text["mode"] == "sft"


def test_sample_workspace_configs_validate():
    """Every sample config is valid, except that a base model not on this machine (the Gemma
    package's GGUF), or the lm-sft run an lm-dpo config refines before it is trained, is
    marked as not found rather than failing after Start."""
    configs = sorted((REPO / "resources" / "sample-workspace" / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        form = RecipeForm.from_file(path)
        field = "model.sft_run" if form.text.get("model.sft_run") else "model.gguf"
        needed = form.text.get(field)
        if needed and not form.resolve(needed).exists():
            assert list(form.errors) == [field], (path, form.errors)
            assert form.errors[field].startswith("not found: ")
        else:
            assert form.valid, (path, form.errors)


def test_new_config_from_a_recipe_template_resolves_in_a_workspace(tmp_path):
    """Every recipe template copied into a workspace's configs/ keeps its comments, and its
    dataset path points at the workspace's datasets/ folder."""
    from app.viewmodels.forms import new_config_from_template, recipe_templates

    ws = make_workspace(tmp_path / "ws", shapes=0, records=False)
    templates = recipe_templates()
    assert {"image-generate", "audio-generate", "lm-pretrain", "lm-sft-pirate"} <= set(templates)
    for stem, template in templates.items():
        path = new_config_from_template(template, ws.configs_dir, f"my-{stem}")
        assert path.read_text().startswith("#")                 # comments kept
        form = RecipeForm.from_file(path)
        data = form.text.get("data.dir") or form.text.get("data.path")
        assert data.startswith("../datasets/"), (stem, data)
        assert form.resolve(data) == (ws.datasets_dir / data.split("/", 2)[2]).resolve()
    with pytest.raises(ForgebenchError, match="already exists"):
        new_config_from_template(templates["lm-pretrain"], ws.configs_dir, "my-lm-pretrain")
    with pytest.raises(ForgebenchError, match="config name"):
        new_config_from_template(templates["lm-pretrain"], ws.configs_dir, "../escape")


# -- masks -------------------------------------------------------------------------------
def test_brush_eraser_undo_redo_and_derived_box():
    editor = MaskEditor(np.zeros((10, 10), bool))
    editor.stroke([(5, 5)], radius=1, value=True)  # a radius-1 disk: the centre and 4 neighbours
    assert sorted(map(tuple, np.argwhere(editor.mask))) == [(4, 5), (5, 4), (5, 5), (5, 6),
                                                           (6, 5)]
    # columns 4..6 of 10 → x0 = 0.4, x1 = 0.7 (exclusive max edge), same for rows.
    assert editor.box() == pytest.approx([0.4, 0.4, 0.7, 0.7])
    editor.stroke([(5, 5)], radius=0.5, value=False)
    assert editor.mask.sum() == 4 and editor.can_undo
    editor.undo()
    assert editor.mask.sum() == 5
    editor.undo()
    assert editor.mask.sum() == 0 and not editor.dirty and editor.box() is None
    editor.redo()
    assert editor.mask.sum() == 5 and editor.can_redo
    editor.stroke([(0, 0), (9, 0)], radius=0.5, value=True)  # a drag fills the whole row
    assert editor.mask[0].all() and not editor.can_redo


def test_holes_and_contours():
    ring = np.zeros((9, 9), bool)
    ring[2:7, 2:7] = True
    ring[4, 4] = False
    assert holes(ring).sum() == 1 and holes(ring)[4, 4]
    assert count_regions(holes(ring)) == 1 and count_regions(ring) == 1
    editor = MaskEditor(ring)
    assert np.array_equal(editor.contour(), boundary(ring))
    two = np.zeros((8, 8), bool)
    two[1, 1] = two[6, 6] = True
    assert count_regions(two) == 2 and holes(two).sum() == 0


def test_saved_mask_edit_is_a_new_valid_dataset_version(tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=12, records=False)
    dataset = load_dataset(ws.datasets_dir / "shapes")
    record = next(r for r in dataset.records() if r["label"] != "empty")
    original_bytes = Path(record["mask"]).read_bytes()
    editor = MaskEditor(read_mask(record["mask"]))
    editor.stroke([(1, 1), (1, 10)], radius=1, value=True)
    saved = save_mask_version(dataset, record, editor)
    assert saved.root != dataset.root and saved.manifest["parent"] == dataset.version
    new_record = next(r for r in saved.records() if r["id"] == record["id"])
    assert np.array_equal(read_mask(new_record["mask"]), editor.mask)
    assert new_record["box"] == pytest.approx(box_from_mask(editor.mask))
    assert Path(record["mask"]).read_bytes() == original_bytes  # the original is untouched
    assert len(saved.records()) == len(dataset.records())


# -- dataset tables ----------------------------------------------------------------------
def _plant(path: Path, line: int, change) -> None:
    lines = path.read_text().split("\n")
    lines[line - 1] = change(lines[line - 1])
    path.write_text("\n".join(lines))


def test_dataset_table_places_findings_on_their_records(tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=10, records=False)
    root = ws.datasets_dir / "shapes"
    records = root / "records.jsonl"
    _plant(records, 4, lambda line: json.dumps(dict(json.loads(line), split="trian")))
    _plant(records, 7, lambda line: "{broken")
    table = DatasetTable(root, check_media=False)
    assert not table.ok
    assert [table.rows[i].where for i in table.error_rows()] == ["line 4", "line 7"]
    split_row = table.rows[3]
    assert [f.field for f in split_row.findings] == ["split"]
    broken = table.rows[6]
    assert broken.record is None and broken.raw == "{broken"
    assert "not valid JSON" in broken.findings[0].reason
    # dataset.json no longer matches the edited file: reported, but not on a record.
    assert any(f.file == "dataset.json" or f.field == "files" or "sha256" in f.reason
               for f in table.general)
    assert [table.rows[i].where for i, r in enumerate(table.rows)
            if table.matches(r, "has:error")] == ["line 4", "line 7"]
    assert all(table.matches(r, "split=trian") == (r.where == "line 4") for r in table.rows)


def test_unparseable_dataset_reports_instead_of_raising(tmp_path):
    root = tmp_path / "broken"
    root.mkdir()
    (root / "dataset.json").write_text("{\n  \"kind\": ")
    table = DatasetTable(root)
    assert not table.ok and table.rows == []
    assert "not valid JSON" in table.general[0].render()


def test_record_edit_and_group_moves_save_new_versions(tmp_path):
    ws = make_workspace(tmp_path / "ws", shapes=10, records=False)
    table = DatasetTable(ws.datasets_dir / "shapes")
    assert table.ok
    bad = dict(table.rows[0].record, split="nowhere")
    assert table.check_record(bad)[0][0] == "split"
    with pytest.raises(ForgebenchError, match="split"):
        table.save_record(0, bad)
    edited = dict(table.rows[0].record, source="relabelled by hand")
    saved = table.save_record(0, edited)
    assert saved.records()[0]["source"] == "relabelled by hand"
    group = table.rows[1].record["group"]
    target = "test" if table.rows[1].record["split"] != "test" else "train"
    moved = DatasetTable(saved.root).save_group_splits({group: target})
    assert {r["split"] for r in moved.records() if r["group"] == group} == {target}
    assert moved.manifest["history"][-1]["note"].startswith("moved groups")
    with pytest.raises(ForgebenchError, match="unknown split"):
        table.save_group_splits({group: "nowhere"})


# -- SFT token view ----------------------------------------------------------------------
def test_marked_spans_split_supervised_from_masked():
    from app.viewmodels.sft import marked_spans, parse_inspect_report
    assert marked_spans("<user>Hi</user>⟦Arr!⟧<eos>⟦⟧") == [
        ("<user>Hi</user>", False), ("Arr!", True), ("<eos>", False)]
    assert marked_spans("⟦all⟧") == [("all", True)]
    report = json.dumps({"summary": {"examples": 2},
                         "samples": [{"line": 3, "input_tokens": 9, "supervised_tokens": 2,
                                      "truncated": True, "marked": "q⟦a⟧"}]})
    samples, summary = parse_inspect_report(report)
    assert summary == {"examples": 2}
    assert samples[0].truncated and samples[0].spans == [("q", False), ("a", True)]


def test_workspace_watch_names_what_changed(tmp_path):
    """New configs, runs, checkpoints, samples and datasets are noticed from listings alone;
    a look with nothing new reports nothing."""
    from app.viewmodels.workspace import Workspace, WorkspaceWatch

    ws = Workspace.create(tmp_path / "ws")
    watch = WorkspaceWatch(ws)
    assert watch.changes() == set()
    (ws.configs_dir / "new.toml").write_text('recipe = "lm-pretrain"\n')
    assert watch.changes() == {"configs"}
    run = ws.runs_dir / "run-1"
    run.mkdir()
    (run / "run.json").write_text("{}")
    assert watch.changes() == {"runs"}
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    assert watch.changes() == {"runs"}
    (run / "samples" / "step-000001").mkdir(parents=True)
    assert watch.changes() == {"runs"}
    (run / "samples" / "step-000001" / "a.png").write_bytes(b"png")
    assert watch.changes() == {"runs"}
    (ws.datasets_dir / "d").mkdir()
    assert watch.changes() == set()          # not a dataset until dataset.json is written
    (ws.datasets_dir / "d" / "dataset.json").write_text("{}")
    assert watch.changes() == {"datasets"}
    assert watch.changes() == set()


def test_dataset_tab_rows_from_reports():
    """The datasets tabs' report-to-rows logic, without Qt: leak findings as table rows and a
    summary, split counts as grouped bars, finding places matched to their record."""
    from collections import Counter

    from app.viewmodels.datasets import Row, leak_rows, row_of_place, stats_bars

    rows, summary = leak_rows({
        "records": 12, "checks": ["ids", "groups"], "leaks": 1, "duplicates": 1,
        "findings": [{"severity": "error", "kind": "same-group", "a": "r1", "b": "r7",
                      "split_a": "train", "split_b": "val", "evidence": {"group": "g1"}},
                     {"severity": "warning", "kind": "near-duplicate", "a": "r2", "b": "r3",
                      "split_a": "train", "split_b": "train", "evidence": {"distance": 0.01}}]})
    assert [r.cells for r in rows] == [
        ("LEAK", "same-group", "r1 (train)", "r7 (val)", "group g1"),
        ("duplicate", "near-duplicate", "r2 (train)", "r3 (train)", "distance 0.01")]
    assert (rows[0].a_id, rows[0].b_id) == ("r1", "r7")
    assert summary == ("12 records checked (ids, groups): 1 leak(s) across splits, "
                       "1 duplicate(s) within a split")

    bars = stats_bars({"val": Counter(circle=1), "train": Counter(circle=3, square=2)})
    assert bars.labels == ["circle", "square"] and bars.splits == ["train", "val"]
    assert bars.heights == {"train": [3, 2], "val": [1, 0]}
    assert bars.totals == {"val": 1, "train": 5}

    table_rows = [Row(f"line {n}", None) for n in (1, 10, 11)]
    assert row_of_place(table_rows, "line 10 field 'label'") == 1
    assert row_of_place(table_rows, "line 11") == 2
    assert row_of_place(table_rows, "line 100") is None


def test_throughput_is_samples_per_second_for_a_run_without_tokens(tmp_path):
    """An image or sound run logs examples/s; its throughput is never "0 tokens/s"."""
    from app.viewmodels.runs import RunSeries
    from engine.rundir import RunDir

    for name, record, expected in (
            ("lm", {"tokens_per_s": 120.0}, ("tokens_per_s", "tokens/s")),
            ("image", {"examples": 8, "examples_per_s": 3.5}, ("examples_per_s", "samples/s"))):
        run = RunDir(tmp_path / name)
        run.create({"recipe": name, "config": {}})
        for step in (1, 2):
            run.log_metric({"step": step, "split": "train", "loss": 1.0, **record})
        run.release_lock()
        series = RunSeries(run.path)
        series.poll()
        assert series.throughput == expected
        assert series.xy(expected[0])[1] == [list(record.values())[-1]] * 2
