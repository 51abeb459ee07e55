"""The export wizard's "Hugging Face folder (merged safetensors)" format
(app/viewmodels/export_wizard.py hf_export_refusal / hf_export_argv over
`forgebench export RUN --format hf`): an lm-sft run whose base the library converted from a
Hugging Face folder exports as a job to a folder that round-trips (converted back to GGUF, its
tensors are the run's merged f32 GGUF's, bit for bit); a run trained on a plain GGUF shows the
engine's refusal before anything runs, and choosing the HF source folder lifts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from app_part2_support import go_and_wait, wait_for
from export_support import SFT_CONFIG
from hf_fixtures import make_raw_llama
from media_support import forgebench

from app.viewmodels import export_wizard as vm
from app.viewmodels.workspace import Workspace
from app.views.export_wizard import ExportWizardPane
from engine import model_library
from engine.export.bundle import export_run
from engine.gguf.writer import read_gguf_content
from engine.hf.convert import convert_hf

PAIRS = [("say hello", "hello world"), ("name a fox", "quick brown fox"),
         ("what runs", "the dog runs")]


def _sft(root: Path, base: Path, name: str, data: Path) -> Path:
    config = root.parent / f"{name}.toml"
    config.write_text(SFT_CONFIG.format(steps=2, gguf=base, data=data)
                      .replace("max_len = 96", "max_len = 256"))
    forgebench("run", str(config), "--out", str(root / "runs" / name))
    return root / "runs" / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Workspace, Path, Path, Path]:
    """(workspace, the HF folder, a run over the library's conversion of it, a run over a
    plain GGUF of the same weights that never passed through the library)."""
    tmp = tmp_path_factory.mktemp("hf-wizard")
    folder = make_raw_llama(tmp / "tiny-llama")
    workspace = Workspace.create(tmp / "ws")
    entry = model_library.add_model(workspace.root, folder)
    plain = convert_hf(folder, tmp / "plain.gguf", entry["hf_dtype"]).path
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps({"instruction": q, "response": a}) + "\n"
                            for q, a in PAIRS))
    from_hf = _sft(workspace.root, workspace.root / entry["path"], "from-hf", data)
    from_gguf = _sft(workspace.root, plain, "from-gguf", data)
    return workspace, folder, from_hf, from_gguf


def _pane(qtbot, workspace: Workspace, run: Path) -> ExportWizardPane:
    pane = ExportWizardPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    pane.select_run(run)
    go_and_wait(qtbot, pane, 3)
    pane.format.setCurrentIndex(pane.format.findData("hf"))
    return pane


def test_the_hf_format_writes_a_folder_that_round_trips(qtbot, runs, tmp_path):
    workspace, folder, run, _ = runs
    pane = _pane(qtbot, workspace, run)
    assert pane.hf_reason.text() == "" and pane.export_button.isEnabled()
    assert not pane.hf_source.isHidden()           # the source row is offered
    pane.out_name.setText("hf-out")
    pane.export()
    assert pane.export_job.running
    wait_for(qtbot, pane.export_job, 300)
    out = workspace.root / "exports" / "hf-out"
    written = dict(vm.hf_export_written(out))
    assert {"config.json", "model.safetensors", "tokenizer.model",
            "tokenizer_config.json", "README.md"} <= set(written)
    shown = pane.verdict.text()
    assert "merged Hugging Face folder" in shown and all(name in shown for name in written)
    # the round trip: the folder converted back equals the run's own merged f32 GGUF
    bundle = export_run(run, tmp_path / "bundle", dtype="f32", report=False)
    merged = tmp_path / "bundle" / next(f for f in bundle.files if f.endswith(".gguf"))
    again = convert_hf(out, tmp_path / "again.gguf", "f32").path
    a, b = read_gguf_content(merged), read_gguf_content(again)
    assert {t.name: bytes(t.data) for t in a.tensors} == {t.name: bytes(t.data) for t in b.tensors}
    # the twin: the base alone (not merged) differs, so the comparison sees the LoRA
    base = read_gguf_content(convert_hf(folder, tmp_path / "base.gguf", "f32").path)
    assert {t.name: bytes(t.data) for t in base.tensors} != \
        {t.name: bytes(t.data) for t in b.tensors}
    assert (out / "tokenizer.model").read_bytes() == (folder / "tokenizer.model").read_bytes()


def test_a_gguf_only_run_shows_the_engines_refusal_until_a_source_is_chosen(qtbot, runs):
    workspace, folder, _, run = runs
    pane = _pane(qtbot, workspace, run)
    assert "did not come from a Hugging Face folder" in pane.hf_reason.text()
    assert "--hf-source" in pane.hf_reason.text()
    assert not pane.export_button.isEnabled()
    pane.out_name.setText("refused")
    pane.export()                             # refused at once, no job, nothing written
    assert not pane.export_job.running
    assert not (workspace.root / "exports" / "refused").exists()
    pane.hf_source.setText(str(folder.parent / "no-such-folder"))
    pane._format_chosen()
    assert "not a folder" in pane.hf_reason.text()
    # the twin: the base's HF folder chosen, the option is offered
    pane.hf_source.setText(str(folder))
    pane._format_chosen()
    assert pane.hf_reason.text() == "" and pane.export_button.isEnabled()
    assert vm.hf_export_argv(run, "latest", Path("o"), hf_source=folder)[-2:] == \
        ["--hf-source", str(folder)]
    # back to GGUF: no refusal shown, the export button back
    pane.hf_source.clear()
    pane.format.setCurrentIndex(pane.format.findData("gguf"))
    assert pane.hf_reason.text() == "" and pane.export_button.isEnabled()
    assert pane.hf_source.isHidden()
