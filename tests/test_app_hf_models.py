"""The Models pane's "Add HF folder…" as a job (app/viewmodels/models.py AddFolderJob over
`forgebench models add DIR --progress-json`): a real engine subprocess converting a tiny
Hugging Face folder built here, its progress (tensor, bytes, ETA) in the pane's bar and the
jobs panel, the library entry at the end; a cancel mid-way leaves no entry and no finished
file (its twin, not cancelled, has both), and the same add afterwards resumes and finishes."""

from __future__ import annotations

import json

from app_part2_support import wait_for
from hf_fixtures import make_raw_llama

from app.viewmodels import models as vm
from app.viewmodels.workspace import Workspace
from app.views.jobs_panel import job_center
from app.views.models_pane import ModelsPane
from engine import model_library
from engine.gguf.writer import partial_paths, read_gguf_content
from engine.hf.convert import convert_hf


def _pane(qtbot, tmp_path) -> tuple[ModelsPane, Workspace]:
    workspace = Workspace.create(tmp_path / "ws")
    pane = ModelsPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    qtbot.waitUntil(lambda: not pane.call.running)
    return pane, workspace


def test_the_progress_lines_are_read_across_chunks(tmp_path):
    job = vm.AddFolderJob(tmp_path, tmp_path / "tiny")
    line = json.dumps({"progress": {"tensor": "blk.0.attn_q.weight", "index": 3, "tensors": 21,
                                    "bytes": 250_000, "total": 1_000_000, "eta_s": 12.0}})
    assert job.feed("some warning\n" + line[:30]) is None        # half a line: nothing yet
    done, total, stage = job.feed(line[30:] + "\n")
    assert (done, total) == (250, 1000)
    assert stage.startswith("tensor 3/21 blk.0.attn_q.weight") and "ETA 12 s" in stage
    ok, message = job.result(True, "")
    assert not ok                       # the job printed no entry: not reported as added


def test_adding_an_hf_folder_shows_progress_and_ends_in_the_library(qtbot, tmp_path):
    folder = make_raw_llama(tmp_path / "tiny-llama")
    pane, workspace = _pane(qtbot, tmp_path)
    stages: list[str] = []
    job_center().changed.connect(lambda: stages.extend(
        j.stage for j in job_center().jobs.values() if j.kind == "conversion" and j.stage))
    ended: list[tuple[str, bool, str]] = []
    job_center().finished.connect(lambda *a: ended.append(a))
    pane.add_file(str(folder))                  # a folder: the conversion job, not a copy
    assert pane.folder_job.running and pane.busy
    wait_for(qtbot, pane.folder_job, 120)
    qtbot.waitUntil(lambda: not pane.busy)
    n = len(read_gguf_content(convert_hf(folder, tmp_path / "ref.gguf", "bf16").path).tensors)
    # the jobs panel saw every tensor's line, the last one with all the bytes
    assert any(s.startswith(f"tensor {n}/{n} ") for s in stages), stages[-3:]
    assert any(s.startswith(f"tensor 1/{n} ") for s in stages)
    assert pane.folder_job.bar.value() == pane.folder_job.bar.maximum() == 1
    entry = model_library.get_entry(workspace.root, "tiny-llama")
    assert entry["mode"] == "hf"
    ours = model_library.entry_path(workspace.root, entry)
    assert ours.read_bytes() == (tmp_path / "ref.gguf").read_bytes()   # the CLI's own bytes
    assert pane.list.count() == 1 and "tiny-llama" in pane.list.item(0).text()
    assert ended and ended[-1][1] and "added tiny-llama" in ended[-1][2]


def test_cancel_mid_way_leaves_no_entry_and_the_next_add_resumes(qtbot, tmp_path, monkeypatch):
    folder = make_raw_llama(tmp_path / "tiny-llama")
    pane, workspace = _pane(qtbot, tmp_path)
    plain_argv = vm.AddFolderJob.argv
    # the engine's testing knob: a pause after each tensor, so the cancel lands mid-way
    monkeypatch.setattr(vm.AddFolderJob, "argv",
                        lambda self: plain_argv(self) + ["--tensor-delay", "0.5"])
    pane.add_hf_folder(str(folder))
    qtbot.waitUntil(lambda: pane.adding is not None and pane.adding.index >= 2, timeout=60_000)
    pane.folder_job.cancel()
    wait_for(qtbot, pane.folder_job, 60)
    target = workspace.root / "models" / "tiny-llama.gguf"
    partial, record = partial_paths(target)
    assert not target.exists()                         # no complete output
    assert model_library.entries(workspace.root) == []  # and no library entry
    assert partial.exists() and json.loads(record.read_text())["done"] >= 2
    assert "nothing was added" in pane.folder_job.status.text()
    assert pane.add_folder.isEnabled()
    # the twin: not cancelled, the same add resumes and the entry is there
    monkeypatch.setattr(vm.AddFolderJob, "argv", plain_argv)
    pane.add_hf_folder(str(folder))
    wait_for(qtbot, pane.folder_job, 120)
    entry = model_library.get_entry(workspace.root, "tiny-llama")
    assert target.is_file() and not partial.exists()
    convert_hf(folder, tmp_path / "ref.gguf", entry["hf_dtype"])
    assert target.read_bytes() == (tmp_path / "ref.gguf").read_bytes()
