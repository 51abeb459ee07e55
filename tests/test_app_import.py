"""Import wizards and the data-card form: a folder of images (with masks), a JSONL file with
its keys mapped, and an audio CSV become new workspace datasets that the engine's own loader
accepts; bad input is reported at its file, line and field; a cancelled or failed import
leaves nothing behind. The card form saves card.json + card.md through the engine."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from app_wait import settle
from PIL import Image
from PySide6.QtCore import Qt

from app.viewmodels import importers as vm
from app.viewmodels.card_form import CardForm
from app.viewmodels.workspace import Workspace
from app.views.datasets_pane import DatasetsPane
from engine.data.card import statement_of, write_card
from engine.data.dataset import load_dataset
from engine.errors import ForgebenchError

REPO = Path(__file__).resolve().parents[1]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _image_folder(root: Path, per_class: int = 3, masks: bool = True) -> Path:
    rng = np.random.default_rng(0)
    for label in ("disc", "square"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{label}{i}.png")
            if masks:
                mask = np.zeros((12, 16), np.uint8)
                mask[2:6, 3:9] = 255
                Image.fromarray(mask).save(root / label / f"{label}{i}{vm.MASK_SUFFIX}")
    return root


def _wav(path: Path, seconds: float = 0.5, rate: int = 16000, channels: int = 1,
         subtype: str = "PCM_16") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)
    soundfile.write(path, np.stack([tone] * channels, 1) if channels > 1 else tone, rate,
                    subtype=subtype)
    return path


RIGHTS = {"train": "yes", "publish_data": "no", "publish_weights": "yes",
          "commercial": "not stated"}


def test_import_and_card_viewmodels_import_neither_qt_nor_torch():
    code = ("import sys, app.viewmodels.importers, app.viewmodels.card_form; "
            "print(any(m.startswith('PySide6') for m in sys.modules), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


# -- view-model: images -----------------------------------------------------------------
def test_image_folder_with_masks_imports_as_a_valid_dataset(tmp_path):
    source = _image_folder(tmp_path / "photos")
    (source / "square" / f"square2{vm.MASK_SUFFIX}").unlink()
    plan = vm.plan_image_folder(source, masks=True)
    assert plan.kind == "image-masks" and not plan.ok
    [missing] = plan.errors
    assert (missing.file, missing.field) == ("square/square2.png", "mask")
    assert "square/square2_mask.png" in missing.reason

    _image_folder(tmp_path / "photos2")
    plan = vm.plan_image_folder(tmp_path / "photos2", masks=True)
    assert plan.ok and len(plan.records) == 6 and plan.records[0].info == "16x12 RGB"
    rights = vm.rights_statement(RIGHTS, "own photographs", "")
    path = vm.import_dataset(plan, tmp_path / "datasets", "shapes-photos",
                             provenance={"description": "my camera"}, rights=rights)
    dataset = load_dataset(path)  # the engine's validator, masks and all
    assert dataset.kind == "image-masks" and dataset.classes == ["disc", "square"]
    records = dataset.raw_records()
    assert [r["label"] for r in records] == ["disc"] * 3 + ["square"] * 3
    files = dataset.files_manifest()
    original = tmp_path / "photos2" / "square" / "square1.png"
    assert files["images/square/square1.png"] == _sha(original)
    assert files["masks/square/square1.png"] == _sha(original.with_name(
        "square1" + vm.MASK_SUFFIX))
    assert dataset.manifest["rights"] == {"train": "yes", "publish_data": "no",
                                          "publish_weights": "yes", "basis": "own photographs"}
    assert dataset.manifest["provenance"]["description"] == "my camera"
    assert not any(p.name.startswith(".") for p in (tmp_path / "datasets").iterdir())


def test_a_cancelled_import_leaves_nothing(tmp_path):
    plan = vm.plan_image_folder(_image_folder(tmp_path / "photos", masks=False))
    copied = []

    def progress(done, total, what):
        copied.append(what)

    with pytest.raises(vm.ImportCancelled):
        vm.import_dataset(plan, tmp_path / "datasets", "photos", provenance={}, rights={},
                          progress=progress, cancelled=lambda: len(copied) >= 3)
    assert len(copied) == 3  # three files were copied into staging before the cancel
    assert list((tmp_path / "datasets").iterdir()) == []


def test_a_broken_file_past_the_preview_fails_the_import_and_leaves_nothing(tmp_path,
                                                                            monkeypatch):
    source = _image_folder(tmp_path / "photos", masks=False)
    (source / "square" / "square2.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    [broken] = vm.plan_image_folder(source).errors  # within the preview: marked at once
    assert (broken.file, broken.field) == ("square/square2.png", "image")
    assert broken.reason.startswith("not a readable image")
    monkeypatch.setattr(vm, "PREVIEW_ROWS", 1)  # the preview decodes only the first image
    plan = vm.plan_image_folder(source)
    assert plan.ok
    with pytest.raises(ForgebenchError, match="square2.png.*not a readable image"):
        vm.import_dataset(plan, tmp_path / "datasets", "photos", provenance={}, rights={})
    assert list((tmp_path / "datasets").iterdir()) == []


# -- view-model: JSONL ------------------------------------------------------------------
def _sft_source(path: Path, broken_line: int | None = None) -> Path:
    lines = [json.dumps({"uid": f"q{i}", "prompt": f"Say {i} like a pirate",
                         "completion": f"Arr, {i}!", "note": "x"}) for i in range(5)]
    if broken_line:
        lines[broken_line - 1] = '{"uid": "q2", "prompt": "unterminated'
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_keys_map_to_fields_and_bad_lines_are_named(tmp_path):
    source = _sft_source(tmp_path / "pairs.jsonl", broken_line=3)
    mapping = vm.default_mapping("text-sft", vm.source_keys(source))
    assert (mapping["id"], mapping["instruction"], mapping["response"]) == \
        ("uid", "prompt", "completion")
    plan = vm.plan_jsonl(source, "text-sft", mapping)
    assert [(f.file, f.where) for f in plan.errors] == [("pairs.jsonl", "line 3")]
    assert "not valid JSON" in plan.errors[0].reason
    with pytest.raises(ForgebenchError, match="line 3"):
        vm.import_dataset(plan, tmp_path / "datasets", "pairs", provenance={}, rights={})

    source = _sft_source(tmp_path / "pairs.jsonl")
    unmapped = dict(mapping, response=None)
    plan = vm.plan_jsonl(source, "text-sft", unmapped)
    assert len(plan.errors) == 5 and all(f.where == f"line {i + 1}" for i, f in
                                         enumerate(plan.errors))
    plan = vm.plan_jsonl(source, "text-sft", mapping)
    path = vm.import_dataset(plan, tmp_path / "datasets", "pairs", provenance={}, rights={})
    records = load_dataset(path).raw_records()
    assert records[4] == {"id": "q4", "instruction": "Say 4 like a pirate",
                          "response": "Arr, 4!"}


def test_captioned_images_are_copied_from_beside_the_jsonl(tmp_path):
    folder = tmp_path / "captions"
    (folder / "pics").mkdir(parents=True)
    Image.new("RGB", (8, 8), "red").save(folder / "pics" / "a.png")
    (folder / "meta.jsonl").write_text(
        json.dumps({"image": "pics/a.png", "caption": "a red square"}) + "\n"
        + json.dumps({"image": "pics/gone.png", "caption": "missing"}) + "\n")
    mapping = vm.default_mapping("captioned-images", vm.source_keys(folder / "meta.jsonl"))
    assert (mapping["file_name"], mapping["text"]) == ("image", "caption")
    plan = vm.plan_jsonl(folder / "meta.jsonl", "captioned-images", mapping)
    [missing] = plan.errors
    assert (missing.where, missing.field) == ("line 2", "file_name")
    (folder / "meta.jsonl").write_text(json.dumps({"image": "pics/a.png",
                                                   "caption": "a red square"}) + "\n")
    plan = vm.plan_jsonl(folder / "meta.jsonl", "captioned-images", mapping)
    path = vm.import_dataset(plan, tmp_path / "datasets", "captions", provenance={},
                             rights={})
    dataset = load_dataset(path)
    assert dataset.files_manifest()["pics/a.png"] == _sha(folder / "pics" / "a.png")
    assert dataset.raw_records()[0]["text"] == "a red square"


# -- view-model: audio CSV --------------------------------------------------------------
def _audio_csv(folder: Path, rows: list[tuple]) -> Path:
    lines = [",".join(vm.AUDIO_COLUMNS)]
    for rel, label, split, digest in rows:
        lines.append(f"{rel},{label},{split},{Path(rel).stem},my recorder,own recording,"
                     f"{digest}")
    (folder / "clips.csv").write_text("\n".join(lines) + "\n")
    return folder / "clips.csv"


def test_audio_csv_rows_are_checked_for_file_hash_and_format(tmp_path):
    folder = tmp_path / "rec"
    good = _wav(folder / "wav" / "good.wav")
    stereo = _wav(folder / "wav" / "stereo.wav", channels=2)
    fast = _wav(folder / "wav" / "fast.wav", rate=44100)
    csv_path = _audio_csv(folder, [
        ("wav/good.wav", "tone", "train", _sha(good)),
        ("wav/stereo.wav", "tone", "train", _sha(stereo)),
        ("wav/fast.wav", "tone", "val", _sha(fast)),
        ("wav/gone.wav", "tone", "val", "0" * 64),
        ("wav/good.wav", "tone", "test", "1" * 64),
    ])
    plan = vm.plan_audio_csv(csv_path)
    by_line = {(f.where, f.field): f.reason for f in plan.errors}
    assert set(by_line) == {("line 3", "path"), ("line 4", "path"), ("line 5", "path"),
                            ("line 6", "sha256"), ("line 6", "id")}
    assert "2 channels" in by_line[("line 3", "path")]
    assert "44100 Hz" in by_line[("line 4", "path")]
    assert "not found" in by_line[("line 5", "path")]
    assert plan.records[0].info == "mono, 16000 Hz, PCM_16, 0.50 s"
    assert plan.records[2].info.startswith("mono, 44100 Hz")

    csv_path = _audio_csv(folder, [("wav/good.wav", "tone", "train", _sha(good))])
    plan = vm.plan_audio_csv(csv_path)
    path = vm.import_dataset(plan, tmp_path / "datasets", "tones", provenance={},
                             rights={})
    dataset = load_dataset(path, require={"audio": vm.AUDIO_SPEC})
    [record] = dataset.raw_records()
    assert record["path"] == "clips/wav/good.wav" and record["sha256"] == _sha(good)


def test_unreadable_sources_and_bad_names_are_reported(tmp_path):
    plan = vm.plan_jsonl(tmp_path / "nowhere.jsonl", "text-corpus", {"text": "text"})
    assert not plan.ok and "cannot read" in plan.errors[0].reason
    (tmp_path / "bad.csv").write_text("file,label\nx.wav,a\n")
    plan = vm.plan_audio_csv(tmp_path / "bad.csv")
    assert plan.errors[0].where == "line 1" and "path" in plan.errors[0].reason
    (tmp_path / "datasets" / "taken").mkdir(parents=True)
    assert "already exists" in vm.check_name(tmp_path / "datasets", "taken")
    assert vm.check_name(tmp_path / "datasets", "../escape") is not None
    assert vm.check_name(tmp_path / "datasets", "fine-name_2") is None


# -- view-model: card -------------------------------------------------------------------
def test_card_form_validates_saves_and_round_trips(tmp_path):
    source = _image_folder(tmp_path / "photos", masks=False)
    path = vm.import_dataset(vm.plan_image_folder(source), tmp_path / "datasets", "photos",
                             provenance={"description": "my camera"},
                             rights=vm.rights_statement(RIGHTS, "", ""))
    form = CardForm(path)
    assert form.text["rights.train"] == "yes" and form.text["sources"] == "my camera"
    form.set_text("rights.commercial", "with conditions")
    assert form.errors["rights.basis"] == "state the conditions for commercial"
    assert not form.valid
    with pytest.raises(ForgebenchError, match="rights.basis"):
        form.save()
    form.set_text("rights.basis", "non-commercial photo licence, resale needs a release")
    form.set_text("task", "tell discs from squares")
    form.set_text("intended_uses", "teaching\nsmoke tests")
    form.set_text("prohibited_uses", "smoke tests")
    assert "intended use" in form.errors["prohibited_uses"]
    form.set_text("prohibited_uses", "identifying people, anything medical")
    assert form.valid
    json_path, md_path = form.save()
    card = json.loads(json_path.read_text())
    assert card["rights"]["commercial"] == "with conditions"
    assert card["prohibited_uses"] == ["identifying people, anything medical"]
    assert card["counts"]["by_class"]  # measured, not stated
    assert "publish_data" not in " ".join(card["missing"])
    assert "rights.commercial" not in card["missing"] and "preprocessing" in card["missing"]
    text = md_path.read_text()
    assert "tell discs from squares" in text and "| Commercial use | with conditions |" in text
    # The saved card re-opens with what was typed, and rewriting the card keeps it.
    again = CardForm(path)
    assert again.text == form.text
    write_card(load_dataset(path))
    assert statement_of(json.loads(json_path.read_text()))["task"] == \
        "tell discs from squares"


# -- GUI flows --------------------------------------------------------------------------
@pytest.fixture
def pane(qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws", name="import test")
    widget = DatasetsPane()
    qtbot.addWidget(widget)
    widget.resize(1300, 800)
    widget.show()
    widget.set_workspace(workspace)
    return widget


def test_jsonl_wizard_maps_previews_names_and_imports(pane, qtbot, tmp_path):
    source = _sft_source(tmp_path / "pairs.jsonl", broken_line=3)
    wizard = pane.open_import("jsonl")
    qtbot.addWidget(wizard)
    wizard.source_path.setText(str(source))
    wizard.jsonl_kind.setCurrentText("text-sft")
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    assert wizard.pages.currentIndex() == 1
    problems = [wizard.problems.item(i).text() for i in range(wizard.problems.count())]
    assert problems == ["error: pairs.jsonl: line 3: not valid JSON (Unterminated string "
                        "starting at)"]
    assert not wizard.next_button.isEnabled()  # blocked while the source has errors
    rows = [wizard.preview.item(r, 0).text() for r in range(wizard.preview.rowCount())]
    assert rows == ["line 1", "line 2", "line 3", "line 4", "line 5"]
    last = 1  # the problems column
    assert wizard.preview.item(2, last).text().startswith("not valid JSON")
    assert wizard.preview.item(2, 0).background().color().name() == "#ffcdd2"
    assert wizard.preview.item(1, last).text() == ""

    _sft_source(source)
    wizard.set_mapping("response", None)
    assert not wizard.next_button.isEnabled()
    assert wizard.preview.item(0, 1).text() == "response: required field is missing"
    wizard.set_mapping("response", "completion")
    assert wizard.next_button.isEnabled()
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    wizard.name.setText("has space")
    assert not wizard.next_button.isEnabled() and wizard.name_error.text()
    wizard.name.setText("pirate-pairs")
    wizard.rights["train"].setCurrentText("yes")
    wizard.basis.setText("written by me")
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    with qtbot.waitSignal(wizard.imported, timeout=60_000):
        qtbot.mouseClick(wizard.import_button, Qt.MouseButton.LeftButton)
    assert wizard.progress.value() == wizard.progress.maximum() > 0
    assert "imported 5 records and 0 files" in wizard.status.text()
    assert not wizard.back_button.isEnabled()
    settle(qtbot, pane)
    new = pane.workspace.datasets_dir / "pirate-pairs"
    assert pane.table is not None and pane.table.root == new and pane.table.ok
    assert len(pane.table.rows) == 5 and pane.table.rows[0].record["instruction"] == \
        "Say 0 like a pirate"
    manifest = json.loads((new / "dataset.json").read_text())
    assert manifest["files"]["records.jsonl"] == _sha(new / "records.jsonl")
    assert manifest["rights"] == {"train": "yes", "basis": "written by me"}
    wizard.close()


def test_a_big_jsonl_is_planned_off_the_gui_thread(pane, qtbot, tmp_path):
    source = tmp_path / "big.jsonl"
    source.write_text("".join(json.dumps({"text": f"document number {i} " + "words " * 10})
                              + "\n" for i in range(15_000)))
    assert source.stat().st_size > 1 << 20
    wizard = pane.open_import("jsonl")
    qtbot.addWidget(wizard)
    wizard.source_path.setText(str(source))
    wizard.jsonl_kind.setCurrentText("text-corpus")
    with qtbot.waitSignal(wizard.plan_ready, timeout=60_000):
        qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
        assert wizard.plan is None and "reading big.jsonl" in wizard.summary.text()
        assert not wizard.next_button.isEnabled()
    assert wizard.plan.ok and len(wizard.plan.records) == 15_000
    assert wizard.plan.records[-1].record["id"] == "line-15000"
    assert wizard.preview.rowCount() == vm.PREVIEW_ROWS and wizard.next_button.isEnabled()
    wizard.close()


def test_image_wizard_cancel_leaves_no_dataset_then_imports(pane, qtbot, tmp_path):
    source = _image_folder(tmp_path / "photos", per_class=150, masks=False)
    wizard = pane.open_import("images")
    qtbot.addWidget(wizard)
    wizard.source_path.setText(str(source))
    with qtbot.waitSignal(wizard.plan_ready, timeout=60_000):  # folders plan off-thread
        qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    assert wizard.plan.ok and wizard.preview.rowCount() == vm.PREVIEW_ROWS
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    assert wizard.name.text() == "photos"
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(wizard.import_button, Qt.MouseButton.LeftButton)
    wizard.cancel_import()
    qtbot.waitUntil(lambda: wizard.worker is None, timeout=60_000)
    assert "cancelled" in wizard.status.text()
    assert list(pane.workspace.datasets_dir.iterdir()) == []
    with qtbot.waitSignal(wizard.imported, timeout=120_000):
        qtbot.mouseClick(wizard.import_button, Qt.MouseButton.LeftButton)
    assert load_dataset(pane.workspace.datasets_dir / "photos", check_media=False).classes \
        == ["disc", "square"]
    assert [e.path.name for e in pane.entries] == ["photos"]
    wizard.close()


def test_audio_wizard_shows_format_and_missing_files_at_their_rows(pane, qtbot, tmp_path):
    folder = tmp_path / "rec"
    good = _wav(folder / "good.wav")
    _wav(folder / "stereo.wav", channels=2)
    csv_path = _audio_csv(folder, [("good.wav", "tone", "train", _sha(good)),
                                   ("stereo.wav", "tone", "train", "0" * 64),
                                   ("gone.wav", "tone", "val", "0" * 64)])
    wizard = pane.open_import("audio")
    qtbot.addWidget(wizard)
    wizard.source_path.setText(str(csv_path))
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    columns = [wizard.preview.horizontalHeaderItem(c).text()
               for c in range(wizard.preview.columnCount())]
    cell = {(wizard.preview.item(r, 0).text(), columns[c]): wizard.preview.item(r, c)
            for r in range(wizard.preview.rowCount()) for c in range(len(columns))}
    assert cell[("line 2", "format")].text() == "mono, 16000 Hz, PCM_16, 0.50 s"
    assert cell[("line 2", "problems")].text() == ""
    assert cell[("line 3", "format")].text().startswith("2 ch, 16000 Hz")
    assert "2 channels" in cell[("line 3", "problems")].text()
    assert "not found" in cell[("line 4", "problems")].text()
    assert cell[("line 4", "path")].background().color().name() == "#ffcdd2"
    assert not wizard.next_button.isEnabled()
    wizard.close()


def test_card_dialog_marks_invalid_fields_and_saves(pane, qtbot, tmp_path):
    source = _image_folder(tmp_path / "photos", masks=False)
    vm.import_dataset(vm.plan_image_folder(source), pane.workspace.datasets_dir, "photos",
                      provenance={}, rights={})
    pane.reload(select=pane.workspace.datasets_dir / "photos")
    settle(qtbot, pane)
    dialog = pane.open_card()
    qtbot.addWidget(dialog)
    widget = dialog.form_widget
    widget.set_value("rights.publish_weights", "with conditions")
    assert widget.editors["rights.basis"].property("invalid")
    assert widget.error_labels["rights.basis"].text().endswith("publish_weights")
    assert not dialog.save_button.isEnabled()
    widget.set_value("rights.basis", "weights only with attribution")
    widget.set_value("known_gaps", "no photos taken at night\nonly two classes")
    assert dialog.save_button.isEnabled()
    qtbot.mouseClick(dialog.save_button, Qt.MouseButton.LeftButton)
    card = json.loads((pane.table.root / "card.json").read_text())
    assert card["known_gaps"] == ["no photos taken at night", "only two classes"]
    assert "only two classes" in dialog.rendered.toPlainText()
    dialog.close()


def test_auto_split_gives_unassigned_groups_a_split_in_a_new_version(pane, qtbot, tmp_path):
    """Imported records start unassigned; Auto-split runs `forgebench data split` and opens
    the new version, whose splits are the engine's group hash (the imported folder is kept)."""
    from engine.data.splits import hash_split, parse_ratios

    source = _image_folder(tmp_path / "photos", masks=False)
    vm.import_dataset(vm.plan_image_folder(source), pane.workspace.datasets_dir, "photos",
                      provenance={}, rights={})
    root = pane.workspace.datasets_dir / "photos"
    pane.reload(select=root)
    settle(qtbot, pane)
    tab = pane.splits_tab
    unassigned = pane.table.unassigned_groups
    assert unassigned == len(pane.table.groups()) > 0 and tab.auto_button.isEnabled()
    before = (root / "dataset.json").read_bytes()
    qtbot.mouseClick(tab.auto_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: pane.table is not None and pane.table.root != root
                    and not pane.loading, timeout=120_000)
    assert (root / "dataset.json").read_bytes() == before          # a new version, not an edit
    assert pane.table.unassigned_groups == 0 and not tab.auto_button.isEnabled()
    ratios = parse_ratios("0.8,0.1,0,0.1")
    assert {g: s for g, s, _ in pane.table.groups()} == \
        {g: hash_split(g, 0, ratios) for g, _, _ in pane.table.groups()}


def test_a_bad_line_is_skipped_or_fixed_in_the_wizard(pane, qtbot, tmp_path):
    """One broken line no longer blocks the import: skip it (recorded in the provenance), or
    fix its text in the wizard (the source file is left untouched)."""
    source = _sft_source(tmp_path / "pairs.jsonl", broken_line=3)
    original = source.read_bytes()
    wizard = pane.open_import("jsonl")
    qtbot.addWidget(wizard)
    wizard.source_path.setText(str(source))
    wizard.jsonl_kind.setCurrentText("text-sft")
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    assert not wizard.next_button.isEnabled()

    wizard.skip_bad.setChecked(True)
    assert wizard.next_button.isEnabled() and wizard.plan.skipped == ["line 3"]
    assert len(wizard.plan.records) == 4 and "1 skipped (line 3)" in wizard.summary.text()
    wizard.skip_bad.setChecked(False)
    assert not wizard.next_button.isEnabled()

    wizard.preview.selectRow(2)                         # the broken line's row
    assert wizard.fix_button.isEnabled() and wizard._selected_line() == 3
    wizard.fix_line(3, json.dumps({"uid": "q2", "prompt": "Say 2 like a pirate",
                                   "completion": "Arr, 2!"}))
    assert wizard.plan.ok and len(wizard.plan.records) == 5
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    wizard.name.setText("fixed-pairs")
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    with qtbot.waitSignal(wizard.imported, timeout=60_000):
        qtbot.mouseClick(wizard.import_button, Qt.MouseButton.LeftButton)
    new = pane.workspace.datasets_dir / "fixed-pairs"
    records = [json.loads(line) for line in (new / "records.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["q0", "q1", "q2", "q3", "q4"]
    manifest = json.loads((new / "dataset.json").read_text())
    assert "3" in manifest["provenance"]["lines_fixed_at_import"]
    assert source.read_bytes() == original
    wizard.close()


def test_skipping_errors_keeps_good_records_and_names_the_rest(tmp_path):
    source = _sft_source(tmp_path / "pairs.jsonl", broken_line=2)
    plan = vm.plan_jsonl(source, "text-sft", vm.default_mapping("text-sft",
                                                                vm.source_keys(source)))
    kept = plan.skipping_errors()
    assert not plan.ok and kept.ok and kept.skipped == ["line 2"]
    assert [r.where for r in kept.records] == ["line 1", "line 3", "line 4", "line 5"]
    assert vm.source_line(source, 2) == '{"uid": "q2", "prompt": "unterminated'


def test_preview_columns_fit_by_wrapping_the_widest_columns():
    wanted, least = [160, 70, 210, 180], [100, 70, 100, 110]
    assert vm.preview_column_widths(wanted, least, 700) == wanted        # they fit as they are
    fitted = vm.preview_column_widths(wanted, least, 560)
    assert sum(fitted) <= 560 and all(f >= lo for f, lo in zip(fitted, least))
    assert fitted[:2] == [160, 70]                       # the narrow ones stay on one line
    assert fitted[2] == fitted[3] < 180                  # the widest wrap, at one width
    assert sum(vm.preview_column_widths(wanted, least, 561)) > 561 - 2   # the widest that fit
    # too narrow even for the least widths: those are kept (a sideways scroll, nothing cut)
    assert vm.preview_column_widths(wanted, least, 300) == least
