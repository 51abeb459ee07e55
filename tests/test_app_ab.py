"""The blind A/B pane over real samples of two checkpoints: keyboard rating of 10 pairs with
identities hidden, the stored hidden mapping, win rate and interval against a hand
computation, a killed app losing no answer, refusal of sessions whose settings differ, and
text sessions ranked by Bradley–Terry and exported as a preference dataset."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from PySide6.QtCore import Qt

from app.viewmodels.ab import ABSession, gather_system
from app.views.ab_pane import ABPane
from app_part2_support import lm_run, media_workspace
from media_support import REPO, forgebench

pytestmark = pytest.mark.slow
KEYS = {"A": Qt.Key.Key_A, "B": Qt.Key.Key_B, "T": Qt.Key.Key_T, "S": Qt.Key.Key_S}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The image run with the same 12 items (3 classes x 4, seed 7) at both checkpoints."""
    ws = media_workspace(tmp_path_factory)
    run = ws.runs_dir / "image"
    for checkpoint in ("step-000002", "step-000004"):
        if not list((run / "samples" / checkpoint).glob("*-seed7-*.png")):
            forgebench("sample", str(run), "--checkpoint", checkpoint, "--n", "4", "--seed", "7")
    return ws


@pytest.fixture
def pane(qtbot, workspace):
    widget = ABPane()
    qtbot.addWidget(widget)
    widget.set_workspace(workspace)
    return widget


def _start(pane, workspace, name, *checkpoints, limit=10, allowed=""):
    for checkpoint in checkpoints:
        pane.check_system(workspace.runs_dir / "image", checkpoint)
    pane.name.setText(name)
    pane.limit.setValue(limit)
    pane.allowed.setText(allowed)
    pane.start_session()


def test_ten_blind_pairs_store_the_mapping_and_give_the_hand_computed_win_rate(
        pane, qtbot, workspace):
    _start(pane, workspace, "two-checkpoints", "step-000002", "step-000004")
    session = pane.session
    assert session.total == 10
    early, late = "image/step-000002", "image/step-000004"
    script = "ABABTABSBB"
    expected = {early: 0.0, late: 0.0}
    for key in script:
        pair = session.current()
        shown = pane.prompt.text() + pane.progress.text() + pane.results.toPlainText()
        assert "step-0000" not in shown and "image/" not in shown        # identities hidden
        if key in "AB":
            expected[pair.left if key == "A" else pair.right] += 1
        elif key == "T":
            expected[early] += 0.5
            expected[late] += 0.5
        qtbot.keyClick(pane, KEYS[key])
    assert session.finished

    lines = [json.loads(x) for x in session.store.path.read_text().splitlines()]
    header, answers = lines[0], lines[1:]
    assert header["type"] == "session" and len(answers) == 10
    mapping = {i: (item, left, right) for i, item, left, right in header["pairs"]}
    for ans, key in zip(answers, script):
        assert (ans["item"], ans["left"], ans["right"]) == mapping[ans["pair"]]
        assert ans["choice"] == {"A": "left", "B": "right", "T": "tie", "S": "skip"}[key]
        assert ans["winner"] == {"A": ans["left"], "B": ans["right"]}.get(key)
        assert ans["rater"] == "me" and ans["time"] > 0

    # by hand: 9 rated (1 skip); ties are half a win; Wilson score interval at z = 1.96
    n = 9
    p = expected[early] / n
    z = 1.959963984540054
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    (row,) = session.results()["pairs"]
    assert (row["a"], row["b"], row["n"], row["ties"]) == (early, late, 9, 1)
    assert row["win_rate_a"] == pytest.approx(p)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((centre - half, centre + half))
    text = pane.results.toPlainText()                       # revealed once finished
    assert early in text and f"{p:.3f}" in text and "Session finished" in pane.prompt.text()
    assert session.results()["bradley_terry"] is None       # only two systems


def test_killing_the_app_mid_session_loses_no_answered_pair(workspace, tmp_path):
    helper = tmp_path / "rate.py"
    helper.write_text(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from PySide6.QtWidgets import QApplication
        from app.viewmodels.workspace import Workspace
        from app.views.ab_pane import ABPane
        app = QApplication([])
        ws = Workspace.open({str(workspace.root)!r})
        pane = ABPane()
        pane.set_workspace(ws)
        for ck in ("step-000002", "step-000004"):
            pane.check_system(ws.runs_dir / "image", ck)
        pane.name.setText("killed")
        pane.start_session()
        for key in "ABTB":
            pane.key_pressed(key)
        print("answered", flush=True)
        time.sleep(600)
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO), QT_QPA_PLATFORM="offscreen")
    proc = subprocess.Popen([sys.executable, str(helper)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "answered", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    path = workspace.root / "ratings" / "killed.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [a["choice"] for a in lines[1:]] == ["left", "right", "tie", "right"]
    mapping = {i: (left, right) for i, _, left, right in lines[0]["pairs"]}
    assert all((a["left"], a["right"]) == mapping[a["pair"]] for a in lines[1:])
    resumed = ABSession.open(path, "me")                    # the session carries on at pair 5
    assert resumed.done == 4 and resumed.current().index == lines[0]["pairs"][4][0]


def test_sessions_whose_settings_differ_are_refused_unless_recorded(pane, workspace):
    run = workspace.runs_dir / "image"
    other = run / "samples" / "step-000004-cfg3"
    if not other.is_dir():
        forgebench("sample", str(run), "--checkpoint", "step-000004", "--n", "4", "--seed", "7",
                   "--cfg", "3.0", "--out", str(other))
    pane.reload()
    _start(pane, workspace, "cfg-refused", "step-000002", "step-000004-cfg3")
    assert pane.session is None
    assert "Refused" in pane.setup_status.text() and "cfg" in pane.setup_status.text()
    assert not (workspace.root / "ratings" / "cfg-refused.jsonl").exists()

    _start(pane, workspace, "cfg-on-purpose", limit=4, allowed="cfg")
    assert pane.session is not None
    header = json.loads((workspace.root / "ratings" / "cfg-on-purpose.jsonl").read_text()
                        .splitlines()[0])
    assert header["recorded_differences"] == ["cfg"]
    assert header["systems"]["image/step-000004-cfg3"]["settings"]["cfg"] == 3.0


def test_text_systems_are_ranked_and_exported_as_preferences(qtbot, tmp_path_factory):
    from app.viewmodels.workspace import Workspace
    from engine.data.dataset import load_dataset

    run = lm_run(tmp_path_factory)
    for checkpoint in ("step-000010", "step-000020", "step-000030"):
        if not (run / "samples" / checkpoint / "samples.jsonl").is_file():
            forgebench("sample", str(run), "--checkpoint", checkpoint, "--n", "1")
    workspace = Workspace.open(run.parents[1])
    pane = ABPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    for checkpoint in ("step-000010", "step-000020", "step-000030"):
        pane.check_system(run, checkpoint)
    pane.name.setText("text")
    pane.rubric.setChecked(True)                            # fidelity first, then style
    pane.start_session()
    session = pane.session
    assert session.kind == "text" and session.total == 3    # 1 prompt x 3 system pairs
    rank = {"lm/step-000010": 0, "lm/step-000020": 1, "lm/step-000030": 2}
    while not session.finished:                             # the later checkpoint always wins
        pair = session.current()
        better = "A" if rank[pair.left] > rank[pair.right] else "B"
        pane.key_pressed(better)                            # fidelity
        assert session.current() == pair and "style" in pane.prompt.text()
        pane.key_pressed("T")                               # style: a tie
    answers = session.store.answers()
    assert all(a["rubric"]["style"] == "tie" and a["choice"] == a["rubric"]["fidelity"]
               for a in answers)
    strengths = session.results()["bradley_terry"]
    assert sorted(strengths, key=strengths.get) == list(rank)
    assert "Bradley–Terry" in pane.results.toPlainText()

    pane.export_preferences()
    dataset = load_dataset(workspace.datasets_dir / "preferences-text")
    assert dataset.kind == "preferences"
    outputs = {name: gather_system(run, name.split("/")[1])["outputs"] for name in rank}
    records = dataset.records()
    assert len(records) == 3
    for record, ans in zip(records, answers):
        loser = ans["right"] if ans["choice"] == "left" else ans["left"]
        assert record["prompt"] == ans["item"] == "Record item"
        assert record["chosen"] == outputs[ans["winner"]]["Record item"]
        assert record["rejected"] == outputs[loser]["Record item"]
