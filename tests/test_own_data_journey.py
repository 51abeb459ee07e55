"""A new user's own data, start to result (issue 46, item 8): a folder of greyscale PNGs and a
CSV with only a header are imported through the GUI's import wizard (pytest-qt), split, and
trained by the real engine in subprocesses (image-classify and tabular-classify, a few
steps); `data init --kind tabular` on a 30-column CSV needs no column typed. The material is
scikit-learn's digits (8x8 greyscale, saved as L-mode PNGs) and breast-cancer table (30
numeric columns and a 0/1 target), small slices of each."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from app_wait import settle
from PIL import Image
from PySide6.QtCore import Qt

from app.viewmodels.workspace import Workspace
from app.views.datasets_pane import DatasetsPane
from engine.data.card import build_card, render_markdown
from engine.data.dataset import load_dataset, validate_dataset

sklearn_datasets = pytest.importorskip("sklearn.datasets")
REPO = Path(__file__).resolve().parents[1]
DIGITS = (0, 1, 7)          # three classes, 30 images each


def forgebench(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def digits_folder(root: Path, per_class: int = 30) -> Path:
    """<digit>/<n>.png, 8-bit greyscale (mode L), scaled from scikit-learn's 0..16."""
    digits = sklearn_datasets.load_digits()
    for label in DIGITS:
        (root / str(label)).mkdir(parents=True)
        images = digits.images[digits.target == label][:per_class]
        for i, pixels in enumerate(images):
            grey = np.round(pixels * (255 / 16)).astype(np.uint8)
            Image.fromarray(grey, "L").save(root / str(label) / f"{i:02d}.png")
    return root


def cancer_csv(path: Path, rows: int = 150) -> Path:
    """The breast-cancer table with its header (30 feature names and `target`), nothing else:
    no schema, no ids, no splits. Rows are interleaved by class so a slice holds both."""
    data = sklearn_datasets.load_breast_cancer()
    order = np.argsort(np.arange(len(data.target)) % 7, kind="stable")[:rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*data.feature_names, "target"])
        for i in order:
            writer.writerow([f"{v:.6g}" for v in data.data[i]] + [int(data.target[i])])
    return path


def config(tmp_path: Path, name: str, data: Path, body: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(body.replace("DATA", str(data)))
    return path


IMAGE_CONFIG = """recipe = "image-classify"
seed = 0
steps = 60
log_every = 5
eval_every = 60
save_every = 60
keep_last = 1
batch_size = 16
include_empty = false

[data]
dir = "DATA"

[image]
size = 16
resize = "stretch"
hflip = false
rot90 = false

[optim]
lr = 3e-3
warmup = 0
"""

TABLE_CONFIG = """recipe = "tabular-classify"
seed = 0
candidates = ["constant", "logistic"]
calibrate = true
calibration = "cross-fit"
calibration_folds = 3

[data]
dir = "DATA"
"""


@pytest.fixture
def pane(qtbot, tmp_path):
    workspace = Workspace.create(tmp_path / "ws", name="own data")
    widget = DatasetsPane()
    qtbot.addWidget(widget)
    widget.resize(1300, 800)
    widget.show()
    widget.set_workspace(workspace)
    return widget


def import_through_wizard(pane, qtbot, source_kind: str, source: Path, name: str, check):
    wizard = pane.open_import(source_kind)
    qtbot.addWidget(wizard)
    wizard.source_path.setText(str(source))
    with qtbot.waitSignal(wizard.plan_ready, timeout=60_000):
        qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    check(wizard)
    assert wizard.plan.ok and wizard.next_button.isEnabled(), wizard.plan.summary()
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    wizard.name.setText(name)
    wizard.rights["train"].setCurrentText("yes")
    wizard.basis.setText("scikit-learn's bundled copy (BSD-3-Clause)")
    qtbot.mouseClick(wizard.next_button, Qt.MouseButton.LeftButton)
    with qtbot.waitSignal(wizard.imported, timeout=120_000):
        qtbot.mouseClick(wizard.import_button, Qt.MouseButton.LeftButton)
    settle(qtbot, pane)
    wizard.close()
    return pane.workspace.datasets_dir / name


def split(root: Path) -> Path:
    done = forgebench("data", "split", str(root), "--ratios", "0.6,0.2,0,0.2", "--seed", "1")
    assert done.returncode == 0, done.stderr
    return root.parent / f"{root.name}-v2"


def test_greyscale_pngs_and_a_header_only_csv_import_train_and_reach_a_result(
        pane, qtbot, tmp_path):
    # -- greyscale PNGs: validate, import and training agree (converted, and counted) ------
    folder = digits_folder(tmp_path / "digits")

    def images_previewed(wizard):
        assert wizard.preview.item(0, 2).text() == "8x8 L (read as RGB)"   # format column

    digits = import_through_wizard(pane, qtbot, "images", folder, "digits", images_previewed)
    report = validate_dataset(digits)
    assert report.ok and report.conversions == {"L": 90}
    assert report.conversion_note() == "90 images converted from L to RGB on load (the " \
                                       "image recipes read 8-bit RGB)"
    card = build_card(load_dataset(digits))
    assert card["conversions"].startswith("90 images converted from L to RGB")
    assert "Conversions on load: 90 images converted from L to RGB" in render_markdown(card)

    digits_v2 = split(digits)
    run = tmp_path / "runs" / "digits"
    done = forgebench("run", str(config(tmp_path, "digits", digits_v2, IMAGE_CONFIG)),
                      "--out", str(run), "--threads", "1")
    assert done.returncode == 0, done.stderr
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 60
    result = forgebench("eval", str(run), "--split", "test")
    assert result.returncode == 0, result.stderr
    scores = json.loads(result.stdout)
    print("digits test split:", {k: scores[k] for k in ("accuracy", "macro_f1", "loss")})
    assert scores["accuracy"] > 0.6        # three classes: chance is a third

    # -- a CSV with a header only: the schema is inferred and confirmed in the wizard ------
    source = cancer_csv(tmp_path / "mine" / "cancer.csv")

    def schema_shown(wizard):
        assert wizard.schema_box.isVisible()
        rows = {wizard.schema_table.item(r, 0).text(): wizard.schema_table.item(r, 4).text()
                for r in range(wizard.schema_table.rowCount())}
        assert len(rows) == 31 and rows["target"] == "target"
        assert sum(role == "feature" for role in rows.values()) == 30
        assert wizard.target_column.currentText() == "target"
        # the user changes the target, sees the refusal at once, and changes it back
        wizard.set_table_roles(target="mean radius")
        assert not wizard.plan.ok and "two" in wizard.plan.errors[0].reason
        assert not wizard.next_button.isEnabled()
        wizard.set_table_roles(target="target")
        assert wizard.plan.ok
        # and unticks a feature it must not learn from, as in the table
        area = next(wizard.schema_table.item(r, 0) for r in range(wizard.schema_table.rowCount())
                    if wizard.schema_table.item(r, 0).text() == "mean area")
        area.setCheckState(Qt.CheckState.Unchecked)
        row = next(r for r in range(wizard.schema_table.rowCount())
                   if wizard.schema_table.item(r, 0).text() == "mean area")
        assert wizard.schema_table.item(row, 4).text() == "ignored"
        assert wizard.schema_table.item(row, 5).text() == "left out by choice"
        assert wizard.schema_table.item(row, 0).checkState() == Qt.CheckState.Unchecked
        assert "mean area" not in wizard.plan.manifest_fields["table"]["features"]

    table = import_through_wizard(pane, qtbot, "table", source, "cancer", schema_shown)
    manifest = json.loads((table / "dataset.json").read_text())
    assert manifest["table"]["target"] == "target" and len(manifest["table"]["features"]) == 29
    assert manifest["table"]["ignored"] == {"mean area": "left out by choice"}
    assert (table / "rows.csv").read_bytes() == source.read_bytes()       # copied as is
    assert load_dataset(table).records()[0]["id"] == "line-2"

    table_v2 = split(table)
    run = tmp_path / "runs" / "cancer"
    done = forgebench("run", str(config(tmp_path, "cancer", table_v2, TABLE_CONFIG)),
                      "--out", str(run))
    assert done.returncode == 0, done.stderr
    val = json.loads((run / "evals" / "selection-step-000001.json").read_text())
    # the logistic model on 90 rows of this table separates the classes well
    assert val["calibrated"]["average_precision"] > 0.9


def test_data_init_infers_a_30_column_table_with_no_column_typed(tmp_path):
    root = tmp_path / "cancer"
    cancer_csv(root / "cancer.csv", rows=80)
    dry = forgebench("data", "init", str(root), "--kind", "tabular", "--dry-run",
                     "--leave-out", "mean area")
    assert dry.returncode == 0, dry.stderr
    assert "ignored (left out by choice)" in dry.stdout and "29 features" in dry.stdout
    assert "nothing written" in dry.stdout and not (root / "dataset.json").exists()
    done = forgebench("data", "init", str(root), "--kind", "tabular")
    assert done.returncode == 0, done.stderr
    assert "target (named like a label, two values)" in done.stdout
    assert "target: target (0/1); 30 features" in done.stdout
    dataset = load_dataset(root)
    table = dataset.manifest["table"]
    assert table["features"] == {name: "number" for name in
                                 sklearn_datasets.load_breast_cancer().feature_names}
    assert dataset.manifest["records"] == "cancer.csv" and len(dataset.records()) == 80

    # the twin: a CSV whose label column has many values is refused, saying what to pass,
    # and nothing is written
    other = tmp_path / "digits"
    other.mkdir()
    digits = sklearn_datasets.load_digits()
    with open(other / "rows.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f"p{i}" for i in range(64)] + ["label"])
        for pixels, label in zip(digits.data[:40], digits.target[:40]):
            writer.writerow([int(v) for v in pixels] + [int(label)])
    refused = forgebench("data", "init", str(other), "--kind", "tabular")
    assert refused.returncode == 2
    assert "'label' looks like the label but holds 10 values" in refused.stderr
    assert "--target COLUMN" in refused.stderr and not (other / "dataset.json").exists()
