"""lm-sft end to end on a tiny random Gemma-3 GGUF with Q4_K weights (QLoRA over packed blocks):
real `forgebench` subprocess jobs, checkpoints, exact resume, bad input, full fine-tuning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lm_pretrain_support import forgebench, tree_digest
from lm_sft_support import PIRATE_PAIRS, tiny_base, write_config, write_pairs

from engine.fsutil import sha256_file
from engine.lora import read_adapters

torch.set_num_threads(1)
ADAPTERS = "adapters.safetensors"

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return tiny_base(tmp_path_factory.mktemp("base"))


def train_losses(run: Path) -> list[float]:
    return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if m.get("split") == "train"]


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_and_writes_before_after(tmp_path, tiny_gguf):
    config = write_config(tmp_path, tiny_gguf, steps=6, save_every=3)
    base_before = sha256_file(tiny_gguf)
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    run = tmp_path / "run"

    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    weights, = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                if e["kind"] == "base_weights"]
    assert weights["mode"] == "packed" and weights["dense_cache_bytes"] == 0
    stages = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
              if e["kind"] == "stage"]
    assert [e["stage"] for e in stages] == ["loading", "encoding", "sample"]
    assert stages[0]["detail"] == f"loading base {tiny_gguf.stat().st_size / 1e6:.0f} MB"
    assert weights["f32_dense_bytes"] > 4 * weights["packed_bytes"]   # Q4_K: ~4.5 bits/weight
    assert all(m["supervised_tokens"] > 0 and m["input_tokens"] > m["supervised_tokens"]
               for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]

    checkpoint = run / "checkpoints" / "step-000006"
    names = sorted(p.name for p in checkpoint.iterdir())
    assert {"adapters.safetensors", "optimizer.safetensors", "trainer_state.json"} <= set(names)
    tensors, meta = read_adapters(checkpoint / "adapters.safetensors")
    assert meta["base_sha256"] == base_before == json.loads(
        (run / "run.json").read_text())["base_model"]["sha256"]
    assert meta["rank"] == "4" and meta["targets"] == "q,v,down" and meta["alpha"] == "8.0"
    assert sorted(tensors)[:3] == ["layers.0.down.lora_a", "layers.0.down.lora_b",
                                   "layers.0.q.lora_a"]
    assert len(tensors) == 2 * 3 * 2
    assert sha256_file(tiny_gguf) == base_before     # the frozen base file is untouched

    before = [json.loads(x) for x in
              (run / "samples" / "step-000000" / "generations.jsonl").read_text().splitlines()]
    after = [json.loads(x) for x in
             (run / "samples" / "step-000006" / "generations.jsonl").read_text().splitlines()]
    assert before[0]["prompt"] == after[0]["prompt"] == "Say hello."
    sidecar = json.loads((run / "samples" / "step-000006" / "generations.json").read_text())
    assert sidecar["model"]["base_sha256"] == base_before and sidecar["step"] == 6

    result = forgebench("generate", str(run), "--prompt", "Say hello.", "--max-tokens", "6",
                        "--json")
    assert json.loads(result.stdout)["text"] == after[0]["answer"]

    def sampled(*flags: str) -> dict:
        return json.loads(forgebench("generate", str(run), "--prompt", "Say hello.",
                                     "--max-tokens", "6", "--json", *flags).stdout)

    # --temperature, --top-k and --seed reach the sampler, as they do for lm-pretrain runs
    hot = [sampled("--temperature", "5", "--seed", seed) for seed in ("1", "1", "2")]
    assert hot[0]["text"] == hot[1]["text"]                      # a seed reproduces
    assert hot[0]["seed"] == 1 and hot[0]["settings"]["temperature"] == 5.0
    assert any(h["text"] != after[0]["answer"] for h in hot)     # not the greedy answer
    top1 = sampled("--temperature", "5", "--top-k", "1", "--seed", "2")
    assert top1["text"] == after[0]["answer"]                    # top-1 of any temperature


def test_auto_weights_cache_a_small_base_densely_with_the_packed_gradients(tmp_path, tiny_gguf):
    """weights = "auto" takes the f32 dense cache for a model that is a small part of memory
    (and packed for one that is not); loss and adapter gradients equal the packed model's."""
    from engine.config import load_config
    from engine.recipes.lm_sft import encode_samples
    from engine.train.lm_base import load_base, pack, prepare_trainable, weights_mode
    from engine.train.loss import supervised_loss

    def loss_and_grads(weights: str):
        config = load_config(write_config(tmp_path, tiny_gguf, dropout=0.0, weights=weights))
        base = load_base(config)
        adapters, _ = prepare_trainable(config, base)
        with torch.no_grad():
            for a in adapters.values():
                a.lora_b.normal_(0, 0.05, generator=torch.Generator().manual_seed(a.layer))
        samples, _ = encode_samples(config, base)
        loss = supervised_loss(base.model, *pack(samples[:4]))
        loss.backward()
        caches = [w.dense for w in packed_weights(base.model)]
        return base.model.weights_mode, caches, loss.detach(), torch.cat(
            [p.grad.flatten() for a in adapters.values() for p in (a.lora_a, a.lora_b)])

    from engine.models.gguf_model import packed_weights

    mode, caches, loss, grads = loss_and_grads("auto")
    assert mode == "dense-cache" and all(c is not None and c.dtype == torch.float32
                                         for c in caches)
    packed_mode, packed_caches, packed_loss, packed_grads = loss_and_grads("packed")
    assert packed_mode == "packed" and all(c is None for c in packed_caches)
    torch.testing.assert_close(loss, packed_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grads, packed_grads, rtol=1e-5, atol=1e-7)
    report = {"f32_dense_bytes": 1 << 60}
    assert weights_mode("auto", report) == "packed"
    assert weights_mode("dense-cache", report) == "dense-cache"


def test_a_bf16_run_caches_bf16_weights_with_the_numbers_of_an_f32_cache(tmp_path, tiny_gguf):
    """A bf16 run keeps its dense cache in bf16: under bf16 autocast every product casts an
    f32 cache to bf16 at each step, so the bf16 cache gives the same loss and adapter gradients
    at half the memory, while lookups and merges still read the exact weights. Bit for bit
    where both caches go through one kernel; where the bf16 one takes oneDNN's prepacked
    product (`PackedWeight.product`) that was seen bit for bit on AMX, and on other bf16 CPUs,
    never seen, the sums may run in another order: there within bf16 summation noise."""
    from engine.config import load_config
    from engine.models.gguf_model import memory_report, packed_weights
    from engine.models.packed import onednn_bf16
    from engine.recipes.lm_sft import encode_samples
    from engine.train.lm_base import load_base, pack, prepare_trainable
    from engine.train.loss import supervised_loss

    config = load_config(write_config(tmp_path, tiny_gguf, dropout=0.0, weights="dense-cache"))

    def loss_and_grads(precision: str):
        base = load_base(config, precision)
        adapters, _ = prepare_trainable(config, base)
        with torch.no_grad():
            for a in adapters.values():
                a.lora_b.normal_(0, 0.05, generator=torch.Generator().manual_seed(a.layer))
        samples, _ = encode_samples(config, base)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = supervised_loss(base.model, *pack(samples[:4]))
        loss.backward()
        return base.model, loss.detach(), torch.cat(
            [p.grad.flatten() for a in adapters.values() for p in (a.lora_a, a.lora_b)])

    bf16_model, loss, grads = loss_and_grads("bf16")
    f32_model, f32_loss, f32_grads = loss_and_grads("f32")
    assert all(w.cache_dtype == torch.bfloat16 for w in packed_weights(bf16_model))
    if not onednn_bf16() or "amx_bf16" in Path("/proc/cpuinfo").read_text():
        assert torch.equal(loss, f32_loss) and torch.equal(grads, f32_grads)
    else:
        torch.testing.assert_close(loss, f32_loss, rtol=1e-3, atol=0)
        torch.testing.assert_close(grads, f32_grads, rtol=2e-2, atol=1e-4)
    report = memory_report(bf16_model)
    if onednn_bf16():       # held as oneDNN's layouts alone, which the products filled
        assert report["dense_cache_bytes"] == 0
        assert report["onednn_layout_bytes"] >= report["bf16_dense_bytes"]
    else:
        assert report["dense_cache_bytes"] == report["bf16_dense_bytes"]
    for bf16_weight, f32_weight in zip(packed_weights(bf16_model), packed_weights(f32_model)):
        exact = f32_weight.dense                                 # the dequantized f32 values
        assert torch.equal(bf16_weight.rows_f32(0, bf16_weight.rows), exact)
        rows = torch.tensor([[0, 3]])
        assert torch.equal(bf16_weight.take_rows(rows), exact[rows])
        assert torch.equal(bf16_weight.cached_rows(0, bf16_weight.rows), exact.bfloat16())
    # a bf16 cache read outside autocast (a sample during the run) multiplies in bf16
    tokens = torch.tensor([[2, 5, 7]])
    with torch.no_grad():
        torch.testing.assert_close(bf16_model(tokens), f32_model(tokens), rtol=0.05, atol=0.05)


def test_a_bf16_run_is_evaluated_and_answers_from_its_bf16_cache(tmp_path, tiny_gguf,
                                                                 monkeypatch):
    """`forgebench eval` and `generate` of a bf16 run load its cache in bf16, as it trained:
    the loss is the f32 cache's under the same autocast, bit for bit, at half the memory, and
    the greedy answer is the run's own AFTER sample, which its bf16 cache answered."""
    from engine.models.gguf_model import packed_weights
    from engine.recipes import lm_sft
    from engine.rundir import RunDir
    from engine.train.lm_base import load_policy
    from engine.train.lm_reports import mean_loss

    config = write_config(tmp_path, tiny_gguf, steps=2, dropout=0.0, weights="dense-cache",
                          precision="bf16")
    val = write_pairs(tmp_path / "val.jsonl", PIRATE_PAIRS[::-1])
    config.write_text(config.read_text().replace("[lora]", f'val_path = "{val}"\n\n[lora]'))
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    run = RunDir(tmp_path / "run")
    forgebench("eval", str(run.path), "--split", "val")
    record = json.loads((run.path / "evals" / "val-step-000002.json").read_text())

    run_config = lm_sft.run_config(run)
    checkpoint, sha = run.checkpoint(None), run.manifest()["base_model"]["sha256"]
    f32_base, _, _ = load_policy(run_config, checkpoint, sha, precision="f32")   # f32 cache
    samples = lm_sft.encode_samples(run_config, f32_base, split="val")[0]
    losses = {p: mean_loss(f32_base, samples, 2, p).value for p in ("bf16", "f32")}
    assert record["loss"] == losses["bf16"]
    assert record["loss"] != losses["f32"]       # the check sees the precision it runs in
    bf16_base, _ = lm_sft.load_trained(run, checkpoint, precision="bf16")
    assert mean_loss(bf16_base, samples, 2, "bf16").value == record["loss"]
    assert {w.cache_dtype for w in packed_weights(bf16_base.model)} == {torch.bfloat16}

    after = json.loads((run.path / "samples" / "step-000002" / "generations.jsonl")
                       .read_text().splitlines()[0])
    result = forgebench("generate", str(run.path), "--prompt", after["prompt"],
                        "--max-tokens", "6", "--json")
    assert json.loads(result.stdout)["text"] == after["answer"]
    # (the tiny model's six greedy tokens are the same from an f32 cache: which cache the
    # commands load is seen where they load it)
    loaded = []
    monkeypatch.setattr(lm_sft, "load_policy",
                        lambda *a, **k: loaded.append(k["precision"]) or load_policy(*a, **k))
    greedy = SimpleNamespace(prompt=after["prompt"], max_tokens=6, temperature=0.0, top_k=0,
                             top_p=1.0, repetition_penalty=1.0, seed=0)
    assert lm_sft.generate(run, checkpoint, greedy)["text"] == after["answer"]
    lm_sft.evaluate(run, checkpoint, "val")
    assert loaded == ["bf16", "bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("weights,precision", [("packed", "auto"), ("dense-cache", "bf16")])
def test_resume_continues_exactly_with_dropout_and_partial_windows(tmp_path, tiny_gguf,
                                                                   weights, precision):
    """Stop after step 3 (SIGTERM) and resume: same losses and adapters, bit for bit; with a
    bf16 dense cache too, whose products take oneDNN's prepacked layouts where the CPU has bf16
    oneDNN (the resumed process reorders its weights afresh)."""
    straight = tmp_path / "a"
    straight.mkdir()
    forgebench("run", str(write_config(straight, tiny_gguf, steps=6, weights=weights,
                                       precision=precision)), "--out", str(straight / "run"))
    split = tmp_path / "b"
    split.mkdir()
    config = write_config(split, tiny_gguf, steps=6, weights=weights, precision=precision)
    forgebench("run", str(config), "--out", str(split / "run"), "--stop-after-step", "3")
    status = json.loads((split / "run" / "status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == 3
    # Other engine files may change while the suite runs in a shared tree; the exactness
    # asserted below is what resume promises.
    forgebench("resume", str(split / "run"))

    assert train_losses(split / "run") == train_losses(straight / "run")
    # Tensor bytes, not file bytes: safetensors writes its metadata map in hash order.
    a, meta_a = read_adapters(straight / "run" / "checkpoints" / "step-000006" / ADAPTERS)
    b, meta_b = read_adapters(split / "run" / "checkpoints" / "step-000006" / ADAPTERS)
    assert meta_a == meta_b and a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert any(bool(b[name].abs().max() > 0) for name in b if name.endswith("lora_b"))


@pytest.mark.slow
def test_bad_input_is_refused_with_the_reason_and_nothing_is_lost(tmp_path, tiny_gguf):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "a", "response": "b"}) + "\n"
                   + json.dumps({"instruction": "c", "response": "d"}) + "\n"
                   + '{"instruction": "e", "response": }\n')
    config = write_config(tmp_path, tiny_gguf, data=bad)
    result = forgebench("run", str(config), "--out", str(tmp_path / "bad-run"), check=False)
    assert result.returncode != 0
    assert "bad.jsonl: line 3" in result.stderr and "malformed JSON" in result.stderr

    good = tmp_path / "good"
    good.mkdir()
    base = Path(shutil.copy(tiny_gguf, good / "base.gguf"))
    config = write_config(good, base, steps=2)
    forgebench("run", str(config), "--out", str(good / "run"))
    saved = tree_digest(good / "run" / "checkpoints")

    data = good / "pairs.jsonl"
    original = data.read_bytes()
    data.write_bytes(original + b'{"instruction": "new", "response": "pair"}\n')
    result = forgebench("resume", str(good / "run"), "--steps", "4",
                        check=False)
    assert result.returncode != 0 and "training data changed" in result.stderr
    assert "pairs.jsonl has a different SHA-256" in result.stderr
    data.write_bytes(original)

    with open(base, "r+b") as handle:  # same shapes, different bytes: another base
        handle.seek(-8, 2)
        handle.write(b"\x01" * 8)
    result = forgebench("resume", str(good / "run"), "--steps", "4",
                        check=False)
    assert result.returncode != 0 and "base model file changed" in result.stderr

    assert tree_digest(good / "run" / "checkpoints") == saved


def test_adapter_metadata_mismatch_is_refused(tmp_path, tiny_gguf):
    from engine.errors import ForgebenchError
    from engine.lora import attach_lora, load_adapters, save_adapters
    from engine.models.gguf_model import load_gguf_model

    model, _ = load_gguf_model(tiny_gguf)
    adapters = attach_lora(model, targets=["q", "v"], rank=4, alpha=8.0)
    path = save_adapters(tmp_path / "adapters.safetensors", adapters, sha256_file(tiny_gguf))
    other_model, _ = load_gguf_model(tiny_gguf)
    wrong_rank = attach_lora(other_model, targets=["q", "v"], rank=2, alpha=8.0)
    with pytest.raises(ForgebenchError, match="rank is '4' but this model expects '2'"):
        load_adapters(path, wrong_rank, sha256_file(tiny_gguf))
    with pytest.raises(ForgebenchError, match="base model SHA-256"):
        load_adapters(path, adapters, "0" * 64)


@pytest.mark.slow
def test_full_fine_tuning_refuses_a_packed_quantized_base(tmp_path, tiny_gguf):
    config = write_config(tmp_path, tiny_gguf, method="full")
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode != 0
    assert "full fine-tuning needs a dense base" in result.stderr
    assert "Q4_K" in result.stderr


@pytest.mark.slow
def test_full_fine_tuning_of_a_float_gguf_trains_every_weight(tmp_path):
    from fixtures_gguf import write_tiny_gguf
    from safetensors.torch import load_file

    base = write_tiny_gguf(tmp_path / "tiny-f32.gguf", arch="gemma3", qtype="F32", n_layers=2)
    config = write_config(tmp_path, base, method="full", steps=3, dropout=0.0)
    forgebench("run", str(config), "--out", str(tmp_path / "run"))
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 3 and losses[-1] < losses[0]
    weights = load_file(str(tmp_path / "run" / "checkpoints" / "step-000003" / "model.safetensors"))
    assert "tok_embeddings.weight" in weights and "layers.1.mlp.down.weight" in weights
    assert not any(".lora_" in name for name in weights)


def test_window_is_token_weighted_whatever_the_micro_batching():
    """Summed CE / the window's supervised tokens: micro-batches of one sample accumulate to the
    gradient of one packed window, and not to the mean of per-sample means."""
    from types import SimpleNamespace

    from engine.checks.verify_grads import tiny_model
    from engine.train.lm_base import pack
    from engine.train.loss import supervised_loss

    model, adapters, batch = tiny_model(seed=2)
    with torch.no_grad():
        for a in adapters.values():
            a.lora_b.normal_(0, 0.05)
    samples = [SimpleNamespace(input_ids=ids.tolist(), labels=labels.tolist())
               for ids, labels in batch.samples]
    total = sum(sum(x != -100 for x in s.labels) for s in samples)
    assert len({sum(x != -100 for x in s.labels) for s in samples}) == 2  # unequal counts

    def grads(micro_batches, weight):
        model.zero_grad(set_to_none=True)
        for micro in micro_batches:
            inputs, labels, lengths = pack(micro)
            (supervised_loss(model, inputs, labels, lengths) * weight(labels)).backward()
        return torch.cat([a.lora_a.grad.flatten() for a in adapters.values()])

    whole = grads([samples], lambda labels: 1 / total)
    split = grads([[s] for s in samples], lambda labels: 1 / total)
    mean_of_means = grads([[s] for s in samples],
                          lambda labels: 1 / int((labels != -100).sum()) / len(samples))
    torch.testing.assert_close(split, whole, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(mean_of_means, whole, rtol=1e-3)


@pytest.mark.slow
def test_an_lm_pretrain_run_is_a_base_for_lora_and_full_fine_tuning(tmp_path):
    from lm_pretrain_support import make_corpus
    from lm_pretrain_support import write_config as write_pretrain_config

    corpus = make_corpus(tmp_path)
    forgebench("run", str(write_pretrain_config(tmp_path / "pt.toml", corpus, steps=3)),
               "--out", str(tmp_path / "pt"))
    weights = tmp_path / "pt" / "checkpoints" / "step-000003" / "model.safetensors"
    data = write_pairs(tmp_path / "pairs.jsonl")
    for method in ("lora", "full"):
        config = tmp_path / f"{method}.toml"
        config.write_text(f'recipe = "lm-sft"\nsteps = 3\n[model]\nrun = "{tmp_path / "pt"}"\n'
                          f'[data]\npath = "{data}"\nmax_len = 128\n'
                          f'[lora]\nmethod = "{method}"\n[optim]\nlr = 3e-3\n'
                          '[train]\nwindow = 6\nmicro_batch = 6\n')
        forgebench("run", str(config), "--out", str(tmp_path / method))
        losses = train_losses(tmp_path / method)
        assert losses[-1] < losses[0], (method, losses)
        manifest = json.loads((tmp_path / method / "run.json").read_text())
        assert manifest["base_model"]["sha256"] == sha256_file(weights)
    _, meta = read_adapters(tmp_path / "lora" / "checkpoints" / "step-000003" / ADAPTERS)
    assert meta["base_sha256"] == sha256_file(weights) and meta["targets"] == "q,v"


def test_activation_checkpointing_recomputes_the_same_gradients_with_dropout():
    """Recomputed blocks regenerate the same dropout masks, so gradients match exactly."""
    from engine.checks.verify_grads import tiny_model
    from engine.train.lm_base import checkpoint_activations

    def gradients(recompute: bool) -> torch.Tensor:
        model, adapters, batch = tiny_model(seed=4)
        for adapter in adapters.values():
            adapter.dropout = 0.3
        with torch.no_grad():
            for adapter in adapters.values():
                adapter.lora_b.normal_(0, 0.05)
        if recompute:
            checkpoint_activations(model)
        model.train()
        model.lora_clock.set(step=7, micro=1)
        batch.loss(model).backward()
        return torch.cat([p.grad.flatten() for a in adapters.values()
                          for p in (a.lora_a, a.lora_b)])

    plain, recomputed = gradients(False), gradients(True)
    assert torch.equal(plain, recomputed)
    assert plain.abs().max() > 0
