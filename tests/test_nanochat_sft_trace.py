"""The SFT trace rung of the nanochat ladder: a real lm-sft run of a nanochat GPT (the base and
config of tests/data/nanochat/make_sft_trace.py) against nanochat's own chat_sft steps on the
same conversations in the same order (sft_trace.json), per-step loss at the ladder's trace
tolerance; twins show the comparison failing when nanochat's training mask or chat_sft's Muon
momentum is replaced."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from nanochat_support import cpu_kind

from engine.cli import main
from engine.rundir import RunDir

DATA = Path(__file__).parent / "data" / "nanochat"
TRACE = DATA / "sft_trace.json"
TRACE_TOL = 1e-4          # the ladder's per-step loss budget (tests/test_nanochat_parity.py)


def trace_script():
    spec = importlib.util.spec_from_file_location("make_sft_trace", DATA / "make_sft_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trace() -> dict:
    if not TRACE.is_file():
        pytest.skip(f"no SFT trace at {TRACE} (make_sft_trace.py writes it)")
    return json.loads(TRACE.read_text("utf-8"))


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    return trace_script().build(tmp_path_factory.mktemp("sfttrace"))


def run_losses(config: Path, out: Path) -> list[float]:
    assert main(["run", str(config), "--out", str(out), "--threads", "1"]) == 0
    return [m["loss"] for m in RunDir(out).metrics() if m.get("split", "train") == "train"]


def errors(ours: list[float], trace: dict) -> list[float]:
    assert len(ours) == len(trace["loss"])
    return [abs(a - b) / abs(b) for a, b in zip(ours, trace["loss"])]


def test_sft_run_is_nanochats_chat_sft_trace(config, trace, tmp_path):
    """Every step within 1e-4 (relative) of the reference on the kind of CPU and the thread
    count it was summed with; elsewhere the first two steps (training amplifies another
    summation order's rounding, as the pretraining trace measured)."""
    found = errors(run_losses(config, tmp_path / "run"), trace)
    assert max(found[:2]) <= TRACE_TOL, found
    kind = cpu_kind()
    if kind != trace["reference"]["cpu"] or trace["reference"]["threads"] != 1:
        pytest.skip(f"steps 1-2 hold; the trace was summed on {trace['reference']['cpu']}, "
                    f"this is {kind}")
    assert max(found) <= TRACE_TOL, found


def test_twin_every_token_supervised_is_off_the_trace(config, trace, tmp_path, monkeypatch):
    """The user's turn and the calculator's output trained as well: off from the first step."""
    from engine import nanochat_tokenizer

    render = nanochat_tokenizer.render_conversation

    def every_token(tokenizer, conversation, max_tokens=2048):
        ids, mask = render(tokenizer, conversation, max_tokens)
        return ids, [0] + [1] * (len(ids) - 1)

    monkeypatch.setattr(nanochat_tokenizer, "render_conversation", every_token)
    assert errors(run_losses(config, tmp_path / "run"), trace)[0] > TRACE_TOL


def test_twin_constant_muon_momentum_is_off_the_trace(config, trace, tmp_path, monkeypatch):
    """base_train's late momentum (0.95 from the start) instead of chat_sft's 0.85 ramp."""
    from engine.train import lm_base

    monkeypatch.setattr(lm_base, "sft_muon_momentum", lambda step: 0.95)
    assert max(errors(run_losses(config, tmp_path / "run"), trace)) > TRACE_TOL
