"""Lists that refresh while the user points at them (issue 46, item 3): the Runs ledger and the
Blind A/B systems list keep the rows shown in their places (and their check marks and
selection) when runs or checkpoints appear; new entries come after them. The ledger sorts
newest first again once the pointer has left it. And the order the Samples pane shows a run's
checkpoints in (item 7): the best first."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from PySide6.QtCore import Qt

from app.viewmodels.runs import Ledger, stable_order
from app.viewmodels.workspace import Workspace
from engine.rundir import SENTINEL, RunDir


def lm_run(path: Path, created: float, checkpoints: tuple[int, ...] = (10,)) -> Path:
    run = RunDir(path)
    run.create({"recipe": "lm-pretrain", "created": created, "config": {"steps": 20}})
    for step in checkpoints:
        folder = run.checkpoints_dir / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / SENTINEL).write_text("{}")
    run.set_status("completed", step=20, target_steps=20)
    run.release_lock()
    return path


def test_stable_order_keeps_the_shown_entries_in_place():
    assert stable_order(["c", "b", "a"], ["d", "c", "b", "a"]) == ["c", "b", "a", "d"]
    assert stable_order(["c", "b", "a"], ["a", "c"]) == ["c", "a"]        # one removed
    assert stable_order([], ["b", "a"]) == ["b", "a"]
    # twin: a plain sort would have moved every row shown down by one
    assert sorted(["d", "c", "b", "a"]) != stable_order(["c", "b", "a"], ["d", "c", "b", "a"])


def test_the_ledger_holds_its_order_under_the_pointer_then_sorts_newest_first(tmp_path):
    workspace = Workspace.create(tmp_path / "ws")
    now = time.time()
    older = lm_run(workspace.runs_dir / "older", now - 100)
    old = lm_run(workspace.runs_dir / "old", now - 50)
    model = Ledger()            # the ledger's view-model: no Qt
    model.refresh(workspace.run_dirs(), [])
    assert model.paths() == [old, older]
    new = lm_run(workspace.runs_dir / "new", now)
    model.refresh(workspace.run_dirs(), [], hold_order=True)
    assert model.paths() == [old, older, new]        # the rows pointed at did not move
    model.refresh(workspace.run_dirs(), [], hold_order=False)
    assert model.paths() == [new, old, older]        # the pointer left: newest first


def test_the_ab_systems_keep_their_rows_and_check_marks_as_checkpoints_appear(qtbot, tmp_path):
    from app.views.ab_pane import ABPane

    workspace = Workspace.create(tmp_path / "ws")
    lm_run(workspace.runs_dir / "b-run", time.time(), checkpoints=(10, 20))
    pane = ABPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)

    def rows() -> list[tuple[str, str]]:
        return [tuple(pane.systems.item(i).data(Qt.ItemDataRole.UserRole))
                for i in range(pane.systems.count())]

    before = rows()
    assert [name for _, name in before] == ["step-000010", "step-000020"]
    pane.check_system(workspace.runs_dir / "b-run", "step-000020")
    pane.systems.setCurrentRow(1)
    held = pane.systems.item(1)
    # a run whose name sorts first appears, and the first run gains a checkpoint
    lm_run(workspace.runs_dir / "a-run", time.time(), checkpoints=(5,))
    extra = RunDir(workspace.runs_dir / "b-run").checkpoints_dir / "step-000030"
    extra.mkdir()
    (extra / SENTINEL).write_text("{}")
    pane.reload()
    after = rows()
    assert after[:2] == before                          # the rows shown did not move
    assert set(after[2:]) == {(str(workspace.runs_dir / "a-run"), "step-000005"),
                              (str(workspace.runs_dir / "b-run"), "step-000030")}
    assert pane.systems.item(1) is held and pane.systems.currentRow() == 1
    assert pane.chosen() == [(str(workspace.runs_dir / "b-run"), "step-000020")]
    # a run deleted: its rows go, the others keep their order
    shutil.rmtree(workspace.runs_dir / "a-run")
    pane.reload()
    assert rows() == before + [(str(workspace.runs_dir / "b-run"), "step-000030")]


def test_samples_show_the_best_checkpoint_first(tmp_path):
    """Issue 46, item 7: the Samples pane's first columns (and clips) are the best checkpoint's,
    then the others newest first: not the first, still noisy checkpoint."""
    import json

    from app.viewmodels import samples as vm
    from app.viewmodels.runs import write_notes

    run = RunDir(tmp_path / "gen")
    run.create({"recipe": "image-generate", "created": time.time(), "config": {"steps": 60}})
    for step in (20, 40, 60):
        folder = run.samples_dir / f"step-{step:06d}"
        folder.mkdir(parents=True)
        for label in ("circle", "square"):
            (folder / f"{label}-seed7-0.png").write_bytes(b"")
            (folder / f"{label}-seed7-0.json").write_text(json.dumps({"class": label,
                                                                        "seed": 7}))
    run.set_status("completed", step=60, target_steps=60, best_checkpoint="step-000040")
    run.release_lock()

    def order() -> list[str]:
        _, columns, _ = vm.image_grid(vm.run_samples(run.path))
        return [checkpoint for checkpoint, _, _ in columns]

    assert order() == ["step-000040", "step-000060", "step-000020"]
    write_notes(run.path, selected_checkpoint="step-000020")       # the user's choice wins
    assert order() == ["step-000020", "step-000060", "step-000040"]
    write_notes(run.path, selected_checkpoint="")
    run.set_status("completed", step=60, target_steps=60, best_checkpoint=None)  # none: newest
    assert order() == ["step-000060", "step-000040", "step-000020"]


def test_a_run_just_started_is_selected_and_in_sight_under_the_pointer(qtbot, tmp_path,
                                                                        monkeypatch):
    """The Runs pane comes up under the pointer after "Train on these preferences": the
    ledger holds its rows, the new run joins at the end, and it is selected and scrolled to;
    once the pointer leaves it moves to the top, still selected."""
    from app.views.runs_pane import RunsPane

    workspace = Workspace.create(tmp_path / "ws")
    now = time.time()
    for i in range(12):
        lm_run(workspace.runs_dir / f"run-{i:02d}", now - 100 + i)
    pane = RunsPane()
    qtbot.addWidget(pane)
    pane.resize(864, 500)
    pane.show()
    pane.set_workspace(workspace)
    over = [True]
    monkeypatch.setattr(pane.ledger_view, "pointer_over_ledger", lambda: over[0])
    new = workspace.runs_dir / "lm-dpo-new"
    pane.follow = new
    lm_run(new, now)
    pane.poll(force=True)
    assert pane.ledger.paths()[-1] == new and pane.selected_paths() == [new]
    qtbot.wait(100)                         # laid out, then scrolled to
    row = pane.table.visualRect(pane.ledger.index(len(pane.ledger.rows) - 1, 0))
    assert pane.table.viewport().rect().contains(row)
    over[0] = False
    pane.poll(force=True)
    assert pane.ledger.paths()[0] == new and pane.selected_paths() == [new]

