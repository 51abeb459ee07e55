"""The blind A/B pane over real samples of two checkpoints: keyboard rating of 10 pairs with
identities hidden, the stored hidden mapping, win rate and interval against a hand
computation, a killed app losing no answer, refusal of sessions whose settings differ, and
text sessions ranked by Bradley–Terry and exported as a preference dataset."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from app_part2_support import lm_run, media_workspace
from media_support import REPO, forgebench
from PySide6.QtCore import Qt

from app.viewmodels.ab import ABSession, gather_system
from app.views.ab_pane import ABPane

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

    shared = lm_run(tmp_path_factory)
    for checkpoint in ("step-000010", "step-000020", "step-000030"):
        if not (shared / "samples" / checkpoint / "samples.jsonl").is_file():
            forgebench("sample", str(shared), "--checkpoint", checkpoint, "--n", "1")
    # The tiny model answers the same at every checkpoint, and a pair whose two answers are
    # the same text prefers nothing (the preferences kind refuses it): this test's copy of the
    # workspace gives each checkpoint's answer its own ending.
    root = tmp_path_factory.mktemp("ab-text") / "ws"
    shutil.copytree(shared.parents[1], root)
    run = root / "runs" / shared.name
    for checkpoint in ("step-000010", "step-000020", "step-000030"):
        path = run / "samples" / checkpoint / "samples.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**x, "text": f"{x['text']} ({checkpoint})"}) + "\n"
                                for x in lines))
    workspace = Workspace.open(root)
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


def test_the_pane_generates_every_systems_outputs_then_exports_media_preferences(
        pane, qtbot, workspace, tmp_path):
    from engine.data.dataset import load_dataset, validate_dataset
    from engine.fsutil import read_json, sha256_file

    for checkpoint in ("step-000002", "step-000004"):
        pane.check_system(workspace.runs_dir / "image", checkpoint)
    pane.name.setText("generated")
    pane.limit.setValue(0)
    pane.allowed.setText("")
    pane.gen_seeds.setText("11")
    pane.gen_n.setValue(2)
    pane.gen_steps.setValue(3)
    pane.generate_button.click()
    assert len(pane.generation[0]) == 2 and pane.job.running
    qtbot.waitUntil(lambda: pane.session is not None
                    and pane.session.plan.session == "generated", timeout=300_000)

    session = pane.session
    header = session.store.header()
    assert header["generation"] == {"seeds": [11], "n": 2, "cfg": None, "steps": 3,
                                    "class": None}
    assert session.total == 3 * 2                      # 3 classes x 2 samples, one system pair
    for system in header["systems"].values():          # exactly the generated outputs
        assert len(system["outputs"]) == 6 and system["settings"]["steps"] == 3
        for path in system["outputs"].values():
            assert "/ratings/outputs/generated/" in path
            assert read_json(path.replace(".png", ".json"))["seed"] == 11

    choices = ["A", "B", "T", "S", "A", "A"]
    for key in choices:
        qtbot.keyClick(pane, KEYS[key])
    assert session.finished and pane.export_button.isEnabled()
    pane.export_preferences()
    out = workspace.datasets_dir / "preferences-generated"
    assert validate_dataset(out).ok
    dataset = load_dataset(out)
    manifest = read_json(out / "dataset.json")
    assert manifest["kind"] == "media-preferences"
    assert "2 ties and skips" in manifest["provenance"]["not_exported"]
    records = dataset.records()
    answers = [a for a in session.store.answers() if a["choice"] in ("left", "right")]
    assert len(records) == len(answers) == 4
    outputs = {name: s["outputs"] for name, s in header["systems"].items()}
    for record, answer in zip(records, answers):
        loser = answer["right"] if answer["choice"] == "left" else answer["left"]
        assert record["chosen"].is_file() and record["chosen"].parent == out / "files"
        assert sha256_file(record["chosen"]) == sha256_file(outputs[answer["winner"]][
            answer["item"]])
        assert sha256_file(record["rejected"]) == sha256_file(outputs[loser][answer["item"]])
        assert manifest["files"][record["chosen"].relative_to(out).as_posix()] == \
            sha256_file(record["chosen"])
        assert record["prompt"].startswith("class ") and record["rater"] == "me"
        assert record["session"] == "generated"
    (out / "files" / records[0]["rejected"].name).unlink()      # a missing file is caught
    assert not validate_dataset(out).ok


def test_text_systems_answer_the_same_prompts_with_one_settings_dict(qtbot, tmp_path_factory):
    from types import SimpleNamespace

    from app.viewmodels.workspace import Workspace
    from engine.recipes.lm_pretrain import generate
    from engine.rundir import RunDir

    run = lm_run(tmp_path_factory)
    workspace = Workspace.open(run.parents[1])
    pane = ABPane()
    qtbot.addWidget(pane)
    pane.set_workspace(workspace)
    for checkpoint in ("step-000010", "step-000030"):
        pane.check_system(run, checkpoint)
    pane.gen_prompts.setPlainText("Record item\nThe price is")
    pane.gen_max_tokens.setValue(6)
    pane.name.setText("cancelled")
    pane.generate_button.click()
    assert pane.job.running
    pane.job.cancel()                                      # cancel stops the whole queue
    qtbot.waitUntil(lambda: not pane.job.running, timeout=60_000)
    assert pane.session is None and not pane.pending_jobs
    assert "Generation stopped" in pane.setup_status.text()
    assert not (workspace.root / "ratings" / "outputs" / "cancelled").exists()

    pane.name.setText("text-generated")
    pane.generate_button.click()
    assert len(pane.generation[0]) == 2 * 2                # systems x prompts
    qtbot.waitUntil(lambda: pane.session is not None, timeout=300_000)
    header = pane.session.store.header()
    assert header["generation"] == {"prompts": ["Record item", "The price is"],
                                    "max_tokens": 6, "temperature": 0.0, "seed": 0}
    assert pane.session.kind == "text" and pane.session.total == 2
    for name, system in header["systems"].items():        # the engine's own greedy answers
        checkpoint = RunDir(run).checkpoint(name.split("/")[1])
        for prompt, text in system["outputs"].items():
            expected = generate(RunDir(run), checkpoint, SimpleNamespace(
                prompt=prompt, max_tokens=6, temperature=0.0, top_k=0, top_p=1.0,
                repetition_penalty=1.0, seed=0, stop=[]))["text"]
            assert text == expected


def test_an_lm_sft_run_is_compared_with_its_untuned_base_on_the_same_prompts(tmp_path):
    """base vs tuned: `generate --model BASE --chat` and `generate RUN` with one settings dict,
    each job's printed answer parsed and gathered into a session (no Qt: the jobs run here)."""
    from gguf_write_fixtures import write_dense_llama

    from app.viewmodels.ab import (
        BASE,
        generated_systems,
        generation_jobs,
        record_text_output,
        text_settings_of,
    )

    base = write_dense_llama(tmp_path / "base.gguf", dim=128, ffn=256, head_dim=32,
                             n_kv_heads=2, n_layers=2, dtype="F32", seed=4)
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({"instruction": q, "response": a}) + "\n"
        for q, a in [("Say hello.", "Ahoy!"), ("Name a color.", "Ahoy! Red.")]))
    (tmp_path / "sft.toml").write_text(textwrap.dedent(f"""\
        recipe = "lm-sft"
        seed = 1
        steps = 2
        save_every = 0
        [model]
        gguf = "{base}"
        [data]
        path = "{tmp_path / 'pairs.jsonl'}"
        max_len = 64
        [lora]
        rank = 4
        [optim]
        lr = 5e-2
        [train]
        window = 2
        micro_batch = 2
        """))
    run = tmp_path / "ws" / "runs" / "sft"
    forgebench("run", str(tmp_path / "sft.toml"), "--out", str(run))
    settings = text_settings_of(["Say hello."], max_tokens=4)
    jobs = generation_jobs([(str(run), BASE), (str(run), "step-000002")], settings,
                           tmp_path / "ws" / "ratings" / "outputs" / "base-vs-tuned")
    assert jobs[0].argv[jobs[0].argv.index("--model") + 1] == str(base)
    for job in jobs:
        done = subprocess.run(job.argv, cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
        assert done.returncode == 0, done.stderr
        record_text_output(job, done.stderr + done.stdout)
    systems = generated_systems(jobs, settings)
    assert set(systems) == {"sft/base", "sft/step-000002"}
    assert all(set(s["outputs"]) == {"Say hello."} for s in systems.values())
    session = ABSession.create(tmp_path / "ws" / "ratings", "base-vs-tuned", systems, "me",
                               generation=settings)
    assert session.total == 1 and session.store.header()["generation"] == settings
