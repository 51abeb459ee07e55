"""lm-es end to end on tiny random Gemma-3 GGUFs (Q4_K for LoRA over packed blocks, F32 for full
weights): the teacher-forced rewards against an unpacked reference, real `forgebench`
subprocess jobs that raise the reward, exact resume after a real SIGTERM, export, and bad input
(each a one-line error, exit 2, no run folder)."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import pytest
import torch
from lm_pretrain_support import forgebench, popen_forgebench, train_series
from lm_sft_support import PIRATE_PAIRS, tiny_base, write_pairs

from engine.lora import read_adapters
from engine.rundir import RunDir

torch.set_num_threads(1)

PAIRS = [PIRATE_PAIRS[i] for i in (0, 1, 2, 4)]   # four of them, "Say hello." last

CONFIG = """\
recipe = "lm-es"
seed = 2
steps = {steps}
save_every = {save_every}
keep_last = 3

[model]
gguf = "{gguf}"

[data]
path = "{data}"
val_path = "{data}"
max_len = 160

[params]
mode = "{mode}"
rank = 4
alpha = 8.0

[es]
population = {population}
sigma = {sigma}
lr = {lr}
batch = 3
micro_batch = 2
anchor_decay = "{anchor}"
decay = 0.5

[reward]
kind = "{reward}"
max_tokens = 4

[sample]
prompts = ["Say hello."]
max_tokens = 6
"""


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return tiny_base(tmp_path_factory.mktemp("base"))


def write_config(folder: Path, gguf: Path, *, steps=6, save_every=0, mode="lora",
                 population=8, sigma=0.05, lr=0.02, anchor="none", reward="nll") -> Path:
    data = write_pairs(folder / "pairs.jsonl", PAIRS)
    path = folder / "es.toml"
    path.write_text(CONFIG.format(steps=steps, save_every=save_every, gguf=gguf, data=data,
                                  mode=mode, population=population, sigma=sigma, lr=lr,
                                  anchor=anchor, reward=reward))
    return path


def train_rows(run: Path) -> list[dict]:
    return [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if m.get("split") == "train"]


def test_teacher_forced_rewards_match_an_unpacked_reference(tmp_path, tiny_gguf):
    """acc and nll from packed batches with the head at supervised rows only equal the same
    figures from each sample's full logits."""
    import torch.nn.functional as F

    from engine.config import load_config
    from engine.recipes import lm_es
    from engine.train.rewards import RewardSpec, score

    config = load_config(write_config(tmp_path, tiny_gguf))
    base = lm_es.load_base(config)
    samples, _ = lm_es.encode_samples(config, base)
    ce, correct, tokens = 0.0, 0, 0
    with torch.no_grad():
        for s in samples:
            logits = base.model(torch.tensor([s.input_ids]))[0].double()        # [T, V]
            labels = torch.tensor(s.labels)
            keep = labels != -100
            ce += float(F.cross_entropy(logits[keep], labels[keep], reduction="sum"))
            correct += int((logits[keep].argmax(-1) == labels[keep]).sum())
            tokens += int(keep.sum())
        nll = score(base.model, base.tokenizer, samples, RewardSpec("nll"), micro_batch=3)
        acc = score(base.model, base.tokenizer, samples, RewardSpec("acc", ce_weight=0.1), 2)
    assert nll.reward == pytest.approx(-ce / tokens, rel=1e-5)
    assert acc.reward == pytest.approx(correct / tokens + 0.1 * math.exp(-ce / tokens),
                                       rel=1e-5)
    assert acc.accuracy == correct / tokens


def test_rule_reward_scores_the_greedy_answers_to_the_rendered_prompts(tmp_path, tiny_gguf):
    """`rule` answers each sample's prompt (cut from the encoded sample) and compares it with
    the sample's response: the same prompts as a user turn rendered afresh, the same references
    as the JSONL holds."""
    from engine.config import load_config
    from engine.eval.text_reward import rule_reward
    from engine.recipes import lm_es
    from engine.train import lm_base
    from engine.train.rewards import RewardSpec, prompt_and_reference, score

    config = load_config(write_config(tmp_path, tiny_gguf, reward="rule"))
    base = lm_es.load_base(config)
    samples, _ = lm_es.encode_samples(config, base)
    spec = RewardSpec("rule", prefix="Ahoy!", suffix="matey.", max_tokens=4)
    expected = []
    for (question, response), sample in zip(PAIRS, samples):
        assert prompt_and_reference(sample, base.tokenizer)[1] == response
        answer = lm_base.answer(base, question, 4)
        expected.append(rule_reward(answer, response, prefix="Ahoy!", suffix="matey."))
    with torch.no_grad():
        result = score(base.model, base.tokenizer, samples, spec)
    assert result.reward == pytest.approx(sum(expected) / len(expected))
    assert rule_reward("Ahoy! Four, matey.", PAIRS[2][1], prefix="Ahoy!",
                       suffix="matey.") == pytest.approx(1.1)


@pytest.mark.slow
def test_lora_run_raises_the_reward_and_keeps_no_optimizer_state(tmp_path, tiny_gguf):
    config = write_config(tmp_path, tiny_gguf, steps=12, save_every=6, population=8,
                          sigma=0.1, lr=0.05)
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    run = tmp_path / "run"
    rows = train_rows(run)
    assert [m["step"] for m in rows] == list(range(1, 13))
    for key in ("reward", "reward_mean", "reward_max", "reward_min", "reward_std",
                "update_norm", "sigma", "grad_norm", "loss", "lr"):
        assert all(math.isfinite(m[key]) for m in rows), key
    assert all(m["reward_min"] <= m["reward_mean"] <= m["reward_max"] for m in rows)
    # the centre's reward (−CE on the iteration's batch) over the first and last three steps
    first = sum(m["reward"] for m in rows[:3]) / 3
    last = sum(m["reward"] for m in rows[-3:]) / 3
    assert last > first, [m["reward"] for m in rows]
    final = run / "checkpoints" / "step-000012"
    assert sorted(p.name for p in final.iterdir()) == ["adapters.safetensors",
                                                       "model.safetensors",
                                                       "trainer_state.json"]
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["es_iteration"] == 12 and state["es_population"] == 8
    tensors, meta = read_adapters(final / "adapters.safetensors")
    assert meta["rank"] == "4" and any(t.abs().max() > 0 for n, t in tensors.items()
                                       if n.endswith("lora_b"))
    for name in ("step-000000", "step-000012"):
        lines = (run / "samples" / name / "generations.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["prompt"] == "Say hello."
    result = json.loads(forgebench("eval", str(run), "--split", "val").stdout)
    assert result["reward_kind"] == "nll" and result["reward"] == pytest.approx(-result["loss"])


@pytest.mark.slow
def test_sigterm_then_resume_is_bitwise_exact_with_anchored_decay(tmp_path, tiny_gguf):
    steps = 10
    straight = tmp_path / "a"
    straight.mkdir()
    forgebench("run", str(write_config(straight, tiny_gguf, steps=steps, anchor="l2")),
               "--out", str(straight / "run"), "--threads", "1")
    split = tmp_path / "b"
    split.mkdir()
    config = write_config(split, tiny_gguf, steps=steps, anchor="l2")
    out = split / "run"
    proc = popen_forgebench("run", str(config), "--out", str(out), "--threads", "1")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().count('"split": "train"') >= 2:
            break
        time.sleep(0.002)
    # Freeze the job so the signal lands mid-run whatever the machine's load; a real SIGTERM.
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    run = RunDir(out)
    stopped = run.status()["step"]
    assert run.status()["state"] == "stopped" and 2 <= stopped < steps, run.status()
    assert run.latest_checkpoint().step == stopped
    forgebench("resume", str(out))

    reference = RunDir(straight / "run")
    assert train_series(run) == train_series(reference)       # every step, bit for bit
    rows = {m["step"]: m for m in run.current_metrics() if m.get("split") == "train"}
    ref_rows = {m["step"]: m for m in reference.current_metrics() if m.get("split") == "train"}
    for key in ("reward", "reward_mean", "reward_max", "reward_min", "update_norm"):
        assert [rows[s][key] for s in sorted(rows)] == [ref_rows[s][key] for s in sorted(rows)]
    final = f"checkpoints/step-{steps:06d}/adapters.safetensors"
    a, _ = read_adapters(run.path / final)
    b, _ = read_adapters(reference.path / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_full_mode_perturbs_every_weight_of_a_float_base(tmp_path):
    from fixtures_gguf import write_tiny_gguf
    from safetensors.torch import load_file

    base = write_tiny_gguf(tmp_path / "tiny-f32.gguf", arch="gemma3", qtype="F32", n_layers=2)
    config = write_config(tmp_path, base, mode="full", steps=2, population=4, sigma=0.01,
                          lr=0.001)
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    final = tmp_path / "run" / "checkpoints" / "step-000002"
    weights = load_file(str(final / "model.safetensors"))
    assert "tok_embeddings.weight" in weights and "layers.1.mlp.down.weight" in weights
    assert not (final / "adapters.safetensors").exists()
    assert not (final / "optimizer.safetensors").exists()
    assert len(train_rows(tmp_path / "run")) == 2


@pytest.mark.slow
def test_an_lm_es_adapter_exports_through_the_lm_sft_path(tmp_path, tiny_gguf):
    config = write_config(tmp_path, tiny_gguf, steps=2, population=4)
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    forgebench("export", str(tmp_path / "run"), "--dtype", "adapter", "--out",
               str(tmp_path / "bundle"), "--no-report")
    files = sorted(p.name for p in (tmp_path / "bundle").iterdir())
    assert "adapter.gguf" in files and "model_card.md" in files
    assert "recipe `lm-es`" in (tmp_path / "bundle" / "model_card.md").read_text()


@pytest.mark.parametrize("change, message", [
    (dict(reward="likes"), "field 'reward.kind': Input should be 'rule', 'acc' or 'nll'"),
    (dict(sigma=0), "field 'es.sigma': Input should be greater than 0"),
    (dict(sigma=-0.5), "field 'es.sigma': Input should be greater than 0"),
    (dict(population=7), "population 7 is odd; antithetic sampling pairs"),
    (dict(mode="full"), "this base stores quantized blocks (Q4_K"),
])
def test_bad_input_is_one_clear_error_and_exit_2(tmp_path, tiny_gguf, change, message):
    config = write_config(tmp_path, tiny_gguf, **change)
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    if change.get("mode") == "full":
        assert "forgebench convert tiny-gemma3-q4k.gguf --dtype f16" in result.stderr
    assert not (tmp_path / "run").exists()


def test_an_lm_es_checkpoint_answers_in_chat_as_generate_does(tmp_path, tiny_gguf):
    """The Chat pane's worker loads an lm-es run (its base found in the workspace's library by
    its SHA-256, with the ES-tuned adapters) and answers as `forgebench generate` does."""
    from chat_support import chat_answer, generated_answer

    from app.viewmodels.workspace import Workspace
    from engine import model_library

    root = Workspace.create(tmp_path / "ws").root
    model_library.add_model(root, tiny_gguf)
    run = root / "runs" / "es"
    forgebench("run", str(write_config(tmp_path, tiny_gguf, steps=2, population=4)),
               "--out", str(run))
    info, text = chat_answer(run, root, "Say hello.", 6)
    assert (info["recipe"], info["method"]) == ("lm-es", "lora")
    assert text == generated_answer(run, "Say hello.", 6)
