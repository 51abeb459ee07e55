"""PTQTP as an export type (engine/export/quant_choices.py): the size the wizard shows before the
file exists is the size written, the report's weight check reads a weight as the sum of its
planes (and still catches a damaged plane), the picker accepts it, and the export stages skip
llama.cpp, which refuses a 2-plane file."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ForgebenchError
from engine.export import bundle, quality
from engine.export.quant_choices import CHOICES, PTQTP, estimated_bytes, write_export_file
from engine.gguf.parser import parse_gguf
from engine.gguf.quant_policy import ModelFacts
from engine.gguf.reader import open_gguf
from engine.ptqtp import gguf_file
from engine.ptqtp.gguf_file import PLANE2_SUFFIX
from tests.fixtures_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ptqtp-export")
    dense = write_tiny_gguf(folder / "dense.gguf", "llama", "F16")
    with pytest.MonkeyPatch.context() as patch:       # 4 solver rounds: a fast test
        patch.setattr(gguf_file, "decompose", functools.partial(gguf_file.decompose,
                                                                iterations=4))
        return dense, write_export_file(dense, folder / "model.gguf", PTQTP)


def _table(path):
    return [(t.name, tuple(t.shape), t.ggml_type) for t in parse_gguf(path).tensors]


def test_the_estimate_is_the_size_written(exported):
    dense, out = exported
    facts = ModelFacts.from_metadata({k: v for k, v in open_gguf(dense).metadata.items()
                                      if not isinstance(v, list)})
    written = sum(t.end - t.start for t in parse_gguf(out).tensors)
    assert estimated_bytes(_table(dense), facts, PTQTP) == written
    # the other matrices as Q4_K_M holds them (here: the embedding as Q4_K), not left in
    # f16; the twin, the Q4_K_M estimate, is another size
    types = {t.name: t.ggml_type.name for t in parse_gguf(out).tensors}
    assert types["token_embd.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "TQ2_0"
    assert estimated_bytes(_table(dense), facts, "q4_k_m") != written


def test_the_weight_check_sums_the_planes_and_catches_a_damaged_one(exported, tmp_path):
    dense, out = exported
    report = quality.check_weights(out, dense)
    assert report["failed"] == [] and report["checked"] > 0
    assert report["worst"]["type"] == "PTQTP_2_TQ2_0"
    assert 0.05 < report["worst"]["rel_error"] <= report["worst"]["bound"]
    # twin: the second plane's f16 scales multiplied by 16 in one weight
    damaged = tmp_path / "damaged.gguf"
    data = bytearray(out.read_bytes())
    slot = next(t for t in parse_gguf(out).tensors if t.name.endswith(PLANE2_SUFFIX))
    start = slot.start
    for block in range((slot.end - slot.start) // 66):
        scale = np.frombuffer(bytes(data[start + block * 66 + 64:start + block * 66 + 66]),
                              np.float16)
        data[start + block * 66 + 64:start + block * 66 + 66] = (scale * 16).tobytes()
    damaged.write_bytes(bytes(data))
    bad = quality.check_weights(damaged, dense)
    assert [f["name"] for f in bad["failed"]] == [slot.name.removesuffix(PLANE2_SUFFIX)]


def test_the_picker_takes_ptqtp_and_llamacpp_is_no_stage_of_it(exported):
    _, out = exported
    assert bundle._compare_types(["q4_k_m", "ptqtp"], "f16") == ["q4_k_m", "ptqtp"]
    assert bundle._is_quantized(PTQTP) and not CHOICES[PTQTP].llamacpp
    assert bundle._llamacpp_stage(out, "the exported model.gguf in llama.cpp") is None
    with pytest.raises(ForgebenchError, match="quantized file types"):
        bundle._compare_types(["ptqtp2"], "f16")


# -- the export wizard's Measure button ---------------------------------------------------------

def test_the_wizards_picker_types_come_from_the_export_types_and_include_ptqtp():
    """The Measure button's job is the CLI picker over quantized export types, ptqtp among them
    (the twin: a name the export list does not offer is what the CLI refuses)."""
    from app.viewmodels import export_wizard as vm
    from engine.export.quant_choices import QUANTIZED

    assert PTQTP in vm.PICKER_TYPES and set(vm.PICKER_TYPES) <= set(QUANTIZED)
    argv = vm.picker_argv(Path("run"), "latest", Path("out"))
    assert argv[argv.index("--compare") + 1].split(",") == list(vm.PICKER_TYPES)
    with pytest.raises(ForgebenchError, match="--compare"):
        bundle._compare_types(["ptqtp2"], "f16")


@pytest.mark.slow
def test_the_wizard_measures_ptqtp_beside_the_llamacpp_types(qtbot, tmp_path):
    """An lm-sft run over a dense tiny gemma: the wizard's Measure job (`export --compare-only`
    in a subprocess) fills the "keeps" column of the ptqtp row as of the others. The twin: a
    picker result without a ptqtp row leaves that cell empty."""
    import json

    from app_part2_support import go_and_wait, wait_for
    from export_support import SFT_CONFIG
    from media_support import forgebench

    from app.viewmodels.workspace import Workspace
    from app.views.export_wizard import ExportWizardPane

    base = write_tiny_gguf(tmp_path / "base-f16.gguf", arch="gemma3", qtype="F16", n_layers=2)
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({"instruction": q, "response": a}) + "\n" for q, a in
        [("Say hello.", "Ahoy there!"), ("Name a color.", "Ahoy! Red."),
         ("What is the sea?", "Ahoy! Our home.")]))
    config = tmp_path / "sft.toml"
    config.write_text(SFT_CONFIG.format(steps=3, gguf=base, data=tmp_path / "pairs.jsonl"))
    workspace = Workspace.create(tmp_path / "ws")
    run = workspace.runs_dir / "sft"
    forgebench("run", str(config), "--out", str(run))
    pane = ExportWizardPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    pane.select_run(run)
    go_and_wait(qtbot, pane, 2)
    types = [pane.sizes.item(r, 0).text() for r in range(pane.sizes.rowCount())]
    assert PTQTP in types and pane.pick_button.isVisibleTo(pane)
    pane.measure_types()
    wait_for(qtbot, pane.pick_job, 600)

    def keeps() -> dict[str, str]:
        return {pane.sizes.item(r, 0).text(): pane.sizes.item(r, 2).text()
                for r in range(pane.sizes.rowCount()) if pane.sizes.item(r, 2)}

    measured = keeps()
    assert all(measured[t].startswith(("keeps ", "no gain")) for t in (PTQTP, "q8_0")), \
        pane.pick_job.output[-2000:]
    assert measured["f16"] == ""
    assert not list((workspace.root / "exports").glob(".picker-*"))
    picker = {"rows": [{"dtype": "q8_0", "gain_kept": 0.97}], "recommended": "q8_0",
              "split": "validation", "base_loss": 2.0, "fine_tune_loss": 1.0}
    pane.show_picker(picker)
    assert keeps()[PTQTP] == "" and keeps()["q8_0"] == "keeps 97%"
