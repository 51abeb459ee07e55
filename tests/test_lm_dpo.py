"""lm-dpo: the loss on worked numbers, sequence log-probs against a dense log-softmax, the
preference data rules, and real `forgebench` jobs on a tiny random Gemma-3 GGUF (Q4_K, QLoRA)
that start from an lm-sft run: the reference is that run's policy (adapters on), cached once;
exact resume; bad input refused with the reason; eval and adapter export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dpo_support import first_step_margin_tolerance
from lm_pretrain_support import forgebench, tree_digest

from engine.errors import ForgebenchError
from engine.lora import read_adapters
from engine.rundir import RunDir

torch.set_num_threads(1)

SFT_PAIRS = [("Say hello.", "Ahoy there!"), ("What is the sea?", "The sea be our home, matey."),
             ("Name a color.", "Ahoy! Red be fine.")]
PREFERENCES = [
    {"prompt": "Say hello.", "chosen": "Ahoy there, matey!", "rejected": "Hello.",
     "rater": "ana", "session": "s1"},
    {"prompt": "What is the sea?", "chosen": "The sea be our home, matey!",
     "rejected": "It is water.", "rater": "ben", "session": "s1", "rationale": "pirate"},
    {"prompt": "Name a color.", "chosen": "Ahoy! Red be fine, matey!", "rejected": "Red.",
     "rater": "ana", "session": "s2"},
    {"prompt": "Name a fruit.", "chosen": "An apple, matey!", "rejected": "An apple.",
     "outcome": "tie", "rater": "ben"},
]
SFT_CONFIG = """\
recipe = "lm-sft"
seed = 5
steps = 2
[model]
gguf = "{gguf}"
weights = "packed"
[data]
path = "sft.jsonl"
max_len = 160
[lora]
rank = 4
alpha = 8.0
dropout = 0.1
targets = ["q", "v"]
[optim]
lr = 1e-2
[train]
window = 3
micro_batch = 3
"""
DPO_CONFIG = """\
recipe = "lm-dpo"
seed = 1
steps = {steps}
save_every = {save_every}
[model]
sft_run = "{sft_run}"
[data]
path = "{data}"
val_path = "val.jsonl"
max_len = 160
[dpo]
beta = 0.5
[optim]
lr = 2e-2
[train]
window = 3
micro_batch = 2
[sample]
prompts = ["Say hello."]
max_tokens = 4
"""


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_dpo(folder: Path, sft_run: Path, *, steps=4, save_every=2, records=PREFERENCES,
              data: Path | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = data or write_jsonl(folder / "prefs.jsonl", records)
    write_jsonl(folder / "val.jsonl", PREFERENCES[:2])
    path = folder / "dpo.toml"
    path.write_text(DPO_CONFIG.format(steps=steps, save_every=save_every, sft_run=sft_run,
                                      data=data))
    return path


def rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "train"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """A finished 2-step lm-sft QLoRA run (dropout 0.1) over a tiny Q4_K Gemma-3 GGUF."""
    from fixtures_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("sft")
    gguf = write_tiny_gguf(root / "tiny-gemma3-q4k.gguf", arch="gemma3", qtype="Q4_K",
                           n_layers=2)
    write_jsonl(root / "sft.jsonl", [{"instruction": q, "response": a} for q, a in SFT_PAIRS])
    (root / "sft.toml").write_text(SFT_CONFIG.format(gguf=gguf))
    forgebench("run", str(root / "sft.toml"), "--out", str(root / "run"))
    return root / "run"


@pytest.fixture(scope="module")
def dpo_run(sft_run, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dpo")
    forgebench("run", str(write_dpo(folder, sft_run)), "--out", str(folder / "run"))
    return folder / "run"


# -- the loss and the log-probs (no jobs) -------------------------------------------------
def test_preference_loss_on_worked_numbers():
    """Policy −10/−12, reference −11/−11, β 0.1: margin of log-ratios 1 − (−1) = 2."""
    from engine.train.preference import PreferenceLoss, preference_loss

    t = torch.tensor
    args = (t([-10.0]), t([-12.0]), t([-11.0]), t([-11.0]), t([2.0]), t([4.0]))
    dpo = preference_loss(PreferenceLoss(beta=0.1), *args)
    assert dpo.losses.item() == pytest.approx(math.log1p(math.exp(-0.2)), rel=1e-6)  # 0.59814
    assert dpo.chosen_rewards.item() == pytest.approx(0.1)
    assert dpo.rejected_rewards.item() == pytest.approx(-0.1)
    assert dpo.margins.item() == pytest.approx(0.2)
    smoothed = preference_loss(PreferenceLoss(beta=0.1, label_smoothing=0.1), *args)
    assert smoothed.losses.item() == pytest.approx(
        0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2)), rel=1e-6)
    # IPO: per-token log-ratios 1/2 − (−1)/4 = 0.75; (0.75 − 1/(2·0.1))² = 18.0625
    assert preference_loss(PreferenceLoss(beta=0.1, loss="ipo"), *args).losses.item() == \
        pytest.approx(18.0625, rel=1e-6)
    normalized = preference_loss(PreferenceLoss(beta=0.1, length_normalized=True), *args)
    assert normalized.losses.item() == pytest.approx(math.log1p(math.exp(-0.075)), rel=1e-6)


@pytest.mark.parametrize("trainable_head", [False, True])
def test_sequence_logps_match_a_dense_log_softmax_with_their_gradients(trainable_head):
    """Packed samples, fused per-row head (frozen) or plain logits (trained head): the summed
    response log-probs and d(Σ w_k·logp_k)/dθ equal those of full logits, sample by sample."""
    from engine.checks.verify_grads import tiny_model
    from engine.train.lm_base import pack
    from engine.train.preference import sequence_logps

    model, adapters, batch = tiny_model(seed=2)
    model.output.weight.requires_grad_(trainable_head)
    samples = [type("S", (), {"input_ids": i.tolist(), "labels": lab.tolist()})()
               for i, lab in batch.samples]
    weights = torch.tensor([0.7, -1.3], dtype=torch.float64)
    params = [a.lora_a for a in adapters.values()] + [a.lora_b for a in adapters.values()]

    logps, counts = sequence_logps(model, *pack(samples))
    grads = torch.autograd.grad((weights * logps).sum(), params)
    expected = []
    for inputs, labels in batch.samples:
        logits = model.logits(model.hidden(inputs[None]))[0]
        keep = labels != -100
        expected.append(torch.log_softmax(logits[keep], -1).gather(
            1, labels[keep, None]).sum())
    expected = torch.stack(expected)
    expected_grads = torch.autograd.grad((weights * expected).sum(), params)

    assert counts.tolist() == [int((lab != -100).sum()) for _, lab in batch.samples]
    torch.testing.assert_close(logps, expected, rtol=1e-10, atol=0)
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


def test_preference_files_are_validated_with_line_numbers(tmp_path):
    from engine.data.preferences import load_preferences

    good = write_jsonl(tmp_path / "good.jsonl", PREFERENCES)
    pairs, counts = load_preferences(good)
    assert [p.rater for p in pairs] == ["ana", "ben", "ana"]
    assert (counts.records, counts.pairs, counts.ties, counts.skips) == (4, 3, 1, 0)
    assert counts.raters == {"ana": 2, "ben": 1} and counts.sessions == {"s1": 2, "s2": 1}
    assert pairs[1].rationale == "pirate" and pairs[1].session == "s1"

    cases = {
        "same": ({"prompt": "p", "chosen": "Same.", "rejected": "Same. "},
                 "chosen and rejected are the same text"),
        "empty": ({"prompt": "p", "chosen": "  ", "rejected": "b"},
                  "field 'chosen': must not be empty"),
        "missing": ({"prompt": "p", "chosen": "a"}, "field 'rejected': required field"),
        "outcome": ({"prompt": "p", "chosen": "a", "rejected": "b", "outcome": "maybe"},
                    "field 'outcome': must be one of preferred, tie, skip"),
    }
    for name, (record, message) in cases.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", PREFERENCES[:2] + [record])
        with pytest.raises(ForgebenchError) as err:
            load_preferences(path)
        assert err.value.where == "line 3" and message in err.value.render(), name
    ties = write_jsonl(tmp_path / "ties.jsonl", [dict(r, outcome="tie") for r in PREFERENCES[:2]]
                       + [dict(PREFERENCES[2], outcome="skip")])
    with pytest.raises(ForgebenchError, match=r"2 tie\(s\) and 1 skip\(s\)"):
        load_preferences(ties)


def test_config_rules():
    from engine.config import validate_config

    base = {"recipe": "lm-dpo", "data": {"path": "p.jsonl"}, "model": {"sft_run": "r"}}
    config = validate_config(base)
    assert config.dpo.beta == 0.1 and config.dpo.loss == "sigmoid" and config.optim.lr == 5e-6
    for bad, message in (({"model": {}}, "model.sft_run"),
                         ({"lora": {"rank": 4}}, "lora"),
                         ({"dpo": {"loss": "ipo", "label_smoothing": 0.1}},
                          "label_smoothing applies")):
        with pytest.raises(ForgebenchError, match=message):
            validate_config(base | bad)


# -- real jobs ------------------------------------------------------------------------------
@pytest.mark.slow
def test_dpo_from_an_sft_run_learns_the_preference_against_that_run_as_reference(dpo_run,
                                                                                 sft_run):
    metrics = rows(dpo_run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("loss", "reward_margin", "chosen_logp", "rejected_logp", "chosen_reward",
                "rejected_reward", "preference_accuracy", "grad_norm", "pairs"):
        assert all(isinstance(m[key], (int, float)) for m in metrics), key
    # step 1 is the policy at the reference: every margin is 0, the loss log 2 (up to rounding)
    tolerance = first_step_margin_tolerance(
        metrics[0], RunDir(dpo_run).manifest()["config"]["dpo"]["beta"])
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=tolerance)
    assert metrics[0]["reward_margin"] == pytest.approx(0, abs=tolerance)
    assert metrics[-1]["reward_margin"] > metrics[1]["reward_margin"] > 0
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert metrics[-1]["preference_accuracy"] == 1.0

    events = [json.loads(x) for x in (dpo_run / "events.jsonl").read_text().splitlines()]
    encoded, = [e for e in events if e["kind"] == "data_encoded"]
    assert (encoded["records"], encoded["pairs"], encoded["ties"]) == (4, 3, 1)
    assert encoded["raters"] == {"ana": 2, "ben": 1}
    assert [e["kind"] for e in events].count("reference_computed") == 1
    manifest = json.loads((dpo_run / "run.json").read_text())
    sft_manifest = json.loads((sft_run / "run.json").read_text())
    assert manifest["base_model"] == sft_manifest["base_model"]
    assert manifest["data"]["start"]["checkpoint"] == "step-000002"

    tensors, meta = read_adapters(dpo_run / "checkpoints" / "step-000004" / "adapters.safetensors")
    assert meta["base_sha256"] == manifest["base_model"]["sha256"]
    assert meta["rank"] == "4" and meta["targets"] == "q,v"
    before = dpo_run / "samples" / "step-000000" / "generations.jsonl"
    after = dpo_run / "samples" / "step-000004" / "generations.jsonl"
    assert before.is_file() and after.is_file()


@pytest.mark.slow
def test_the_cached_reference_is_the_sft_policy_with_its_adapters_on(dpo_run):
    """The cache equals the log-probs of the SFT checkpoint (adapters on), recomputed here,
    and differs from the raw base's (what switching the adapters off would give)."""
    from engine.jobs import run_config
    from engine.recipes.lm_dpo import REFERENCE_FILE, encode_pairs, load_start, pair_logps
    from engine.train.precision import run_precision

    config = run_config(RunDir(dpo_run))
    cached = json.loads((dpo_run / REFERENCE_FILE).read_text())
    # in the run's precision (bf16 where "auto" found AVX512-BF16 or AMX)
    precision = run_precision(RunDir(dpo_run), config)
    base, adapters, _ = load_start(config, precision)
    pairs, _ = encode_pairs(config, base)
    policy = pair_logps(base.model, pairs, 2, precision)
    assert torch.allclose(policy["chosen"], torch.tensor(cached["chosen"]), rtol=1e-6, atol=0)
    assert torch.allclose(policy["rejected"], torch.tensor(cached["rejected"]), rtol=1e-6, atol=0)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_b.zero_()
    raw = pair_logps(base.model, pairs, 2, precision)
    assert not torch.allclose(raw["chosen"], torch.tensor(cached["chosen"]), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_resume_is_exact_and_reuses_the_reference_cache(tmp_path, sft_run, dpo_run):
    config = write_dpo(tmp_path, sft_run)
    forgebench("run", str(config), "--out", str(tmp_path / "run"), "--stop-after-step", "2")
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "stopped"
    forgebench("resume", str(tmp_path / "run"))

    def strip(r):
        return {k: r[k] for k in ("loss", "reward_margin", "chosen_logp", "grad_norm")}

    assert [strip(r) for r in rows(tmp_path / "run")] == [strip(r) for r in rows(dpo_run)]
    a, _ = read_adapters(dpo_run / "checkpoints" / "step-000004" / "adapters.safetensors")
    b, _ = read_adapters(tmp_path / "run" / "checkpoints" / "step-000004" / "adapters.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert events.count('"reference_computed"') == 1     # the resume read the cache


@pytest.mark.slow
def test_bad_preference_input_is_refused_with_the_reason(tmp_path, sft_run):
    cases = {
        "same": ([PREFERENCES[0], dict(PREFERENCES[1], rejected=PREFERENCES[1]["chosen"])],
                 "prefs.jsonl: line 2", "chosen and rejected are the same text"),
        "empty": ([PREFERENCES[0], dict(PREFERENCES[1], chosen="")],
                  "prefs.jsonl: line 2", "must not be empty"),
        "ties": ([dict(r, outcome="tie") for r in PREFERENCES], "prefs.jsonl",
                 "no preference to learn from: the 4 record(s) are 4 tie(s) and 0 skip(s)"),
    }
    for name, (records, where, message) in cases.items():
        config = write_dpo(tmp_path / name, sft_run, records=records)
        result = forgebench("run", str(config), "--out", str(tmp_path / name / "run"),
                            check=False)
        assert result.returncode == 2, (name, result.stderr)
        assert "error:" in result.stderr and where in result.stderr, (name, result.stderr)
        assert message in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr
        assert not (tmp_path / name / "run").exists()


@pytest.mark.slow
def test_an_sft_adapter_trained_on_another_base_is_refused(tmp_path, sft_run):
    """The SFT checkpoint's adapters claim another base's SHA-256: no DPO run starts on it."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "sft-copy"
    shutil.copytree(sft_run, copy)
    path = copy / "checkpoints" / "step-000002" / "adapters.safetensors"
    tensors, meta = load_file(path), read_adapters(path)[1]
    save_file(tensors, path, metadata=dict(meta, base_sha256="0" * 64))
    # recorded as written (a checkpoint trained on that base): the base check refuses it, not
    # the readers' integrity check (engine/train/integrity.py)
    from engine.train.integrity import file_records

    state_path = path.parent / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["files"].update(file_records(path.parent, [path.name]))
    state_path.write_text(json.dumps(state))
    saved = tree_digest(copy)
    result = forgebench("run", str(write_dpo(tmp_path / "dpo", copy)), "--out",
                        str(tmp_path / "dpo" / "run"), check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "adapter base model SHA-256 is '" + "0" * 64 in result.stderr
    assert "adapters.safetensors" in result.stderr
    assert tree_digest(copy) == saved


@pytest.mark.slow
def test_eval_and_adapter_export_work_as_for_lm_sft(tmp_path, dpo_run):
    result = forgebench("eval", str(dpo_run), "--split", "val")
    record = json.loads((dpo_run / "evals" / "val-step-000004.json").read_text())
    assert record["pairs"] == 2 and record["reward_margin"] > 0, (record, result.stdout)
    assert record["preference_accuracy"] == 1.0 and record["loss"] < math.log(2)

    out = tmp_path / "export"
    forgebench("export", str(dpo_run), "--dtype", "adapter", "--out", str(out), "--no-report")
    assert (out / "adapter.gguf").is_file() and (out / "SHA256SUMS").is_file()


@pytest.mark.slow
def test_dpo_after_full_fine_tuning_trains_every_weight_against_the_sft_weights(tmp_path):
    """An lm-sft run that trained every weight of an f32 GGUF: lm-dpo starts from (and refers
    to) those weights, not the GGUF's, and saves full weights again."""
    from fixtures_gguf import write_tiny_gguf
    from safetensors.torch import load_file

    gguf = write_tiny_gguf(tmp_path / "tiny-f32.gguf", arch="gemma3", qtype="F32", n_layers=2)
    write_jsonl(tmp_path / "sft.jsonl", [{"instruction": q, "response": a} for q, a in SFT_PAIRS])
    (tmp_path / "sft.toml").write_text(SFT_CONFIG.format(gguf=gguf).replace(
        'rank = 4', 'method = "full"\nrank = 4').replace("dropout = 0.1", "dropout = 0.0"))
    forgebench("run", str(tmp_path / "sft.toml"), "--out", str(tmp_path / "sft"))
    config = write_dpo(tmp_path / "dpo", tmp_path / "sft", steps=2, save_every=0)
    config.write_text(config.read_text().replace("lr = 2e-2", "lr = 1e-3"))
    forgebench("run", str(config), "--out", str(tmp_path / "dpo" / "run"))

    metrics = rows(tmp_path / "dpo" / "run")
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)   # reference = SFT weights
    assert metrics[1]["reward_margin"] > 0
    sft = load_file(str(tmp_path / "sft" / "checkpoints" / "step-000002" / "model.safetensors"))
    dpo = load_file(str(tmp_path / "dpo" / "run" / "checkpoints" / "step-000002"
                        / "model.safetensors"))
    assert sft.keys() == dpo.keys() and not any(".lora_" in name for name in dpo)
    assert not torch.equal(sft["layers.1.mlp.down.weight"], dpo["layers.1.mlp.down.weight"])


def test_a_dpo_checkpoint_answers_in_chat_as_generate_does(tmp_path, dpo_run):
    """The Chat pane's worker loads an lm-dpo run (the lm-sft run's base, found in the
    workspace's library by its SHA-256, with the DPO adapters) and answers as `forgebench
    generate` does through the recipe."""
    from chat_support import chat_answer, generated_answer

    from app.viewmodels.chat import sources
    from app.viewmodels.workspace import Workspace
    from engine import model_library

    root = Workspace.create(tmp_path / "ws").root
    model_library.add_model(root, Path(RunDir(dpo_run).manifest()["base_model"]["path"]))
    info, text = chat_answer(dpo_run, root, "Say hello.", 6)
    assert (info["recipe"], info["method"], info["checkpoint"]) == ("lm-dpo", "lora",
                                                                    "step-000004")
    assert text == generated_answer(dpo_run, "Say hello.", 6)

    (root / "runs" / "dpo").symlink_to(dpo_run)
    listed = [s for s in sources(root) if s.kind == "run"]
    assert [s.label for s in listed] == ["run: dpo/step-000002", "run: dpo/step-000004"]
    assert all(s.usable for s in listed)
