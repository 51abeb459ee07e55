"""lm-cartridge (engine/recipes/lm_cartridge.py, engine/cartridge/): the trained KV prefix's
gradients against finite differences, rows from the corpus's own prefill reading exactly as the
corpus in context, the cartridge file tied to its base, serving through generate / chat /
serve-local, and a real run that stops and resumes bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from engine.cartridge.prefix import (
    CartridgeModel,
    attach_cartridge,
    cartridge_bytes,
    load_cartridge,
    prefill_rows,
    read_cartridge,
)
from engine.cartridge.self_study import (
    Conversation,
    answer_logprobs,
    context_ids,
    distillation_loss,
)
from engine.errors import ForgebenchError
from engine.models.gemma3 import Gemma3, Gemma3Config
from engine.recipes.lm_cartridge import CartridgeRows

sys.path.insert(0, str(Path(__file__).parent))
from lm_pretrain_support import forgebench  # noqa: E402

torch.set_num_threads(1)

CORPUS = ("Forgebench trains models on one CPU machine. A run folder holds run.json, "
          "metrics.jsonl and its checkpoints; resume continues a stopped run exactly. ") * 6

CONFIG = """\
recipe = "lm-cartridge"
seed = 3
steps = {steps}
save_every = 2
keep_last = 5

[model]
gguf = "{gguf}"
weights = "packed"

[corpus]
paths = ["corpus.txt"]

[cartridge]
tokens = 16

[self_study]
samples = 4
held_out = 1
chunk_tokens = 40
question_tokens = 5
answer_tokens = 6

[train]
window = 2

[eval]
questions = "questions.jsonl"
max_tokens = 3
"""


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    """A tiny random 6-layer Gemma 3 GGUF (layer 5 global, the rest sliding with a window of 4:
    the cartridge reaches the global layer, as a long document does on the real model)."""
    from fixtures_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("base") / "tiny-gemma3.gguf", arch="gemma3",
                           context_length=2048)


def tiny_gemma_torch(dtype=torch.float32) -> Gemma3:
    """A small random Gemma 3 in the engine's f32 numerics whose outputs depend strongly on
    their context: a sliding-window layer (window 8), a global one, another sliding one."""
    torch.manual_seed(0)
    model = Gemma3(Gemma3Config(vocab_size=64, dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
                                head_dim=16, ffn_dim=128, sliding_window=8,
                                sliding=[True, False, True], max_seq_len=256)).eval()
    with torch.no_grad():      # logits of a few units, not saturated softmaxes
        model.tok_embeddings.weight.mul_(0.2)
    model.kv_dtype = dtype
    return model.to(dtype)


def conversation(prompt: list[int], answer: list[int], k: int = 5, seed: int = 1,
                 vocab: int = 64) -> Conversation:
    """A sample with a random teacher top-k (distinct ids, log-probs of a real distribution)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(answer), vocab, generator=g, dtype=torch.float64)
    top = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return Conversation("question", (0, 0), "q", prompt, answer, top.indices, top.values)


# -- gradients ------------------------------------------------------------------------------
def test_cartridge_gradients_equal_finite_differences():
    """The top-k distillation loss through the trained rows (frozen BOS row + trainable rows,
    read through the cache at positions offset past them; a sliding and a global layer),
    float64: d(loss)/d(row) equals a central difference for keys and values of every layer;
    the frozen row is no parameter."""
    model = tiny_gemma_torch(torch.float64)
    keys, values = prefill_rows(model, [1, 7, 8, 9, 10, 11])
    rows = CartridgeRows(keys, values, frozen=1)
    sample = conversation([1, 20, 21, 22], [23, 24, 25])

    def loss() -> torch.Tensor:
        return distillation_loss(CartridgeModel(model, *rows.rows(), bos_id=1), sample)[0]

    loss().backward()
    numeric = {}
    for name, index in (("k_0", (0, 1, 3)), ("v_0", (1, 4, 0)), ("k_1", (1, 0, 7)),
                        ("v_1", (0, 2, 5)), ("k_2", (1, 3, 2)), ("v_2", (0, 0, 9))):
        param = getattr(rows, name)
        eps = 1e-4     # the loss sums many terms: a smaller step drowns in its rounding
        with torch.no_grad():
            param[index] += eps
            up = float(loss())
            param[index] -= 2 * eps
            down = float(loss())
            param[index] += eps
        numeric[name] = (up - down) / (2 * eps)
        assert param.grad[index] != 0
        assert float(param.grad[index]) == pytest.approx(numeric[name], rel=1e-6)
    assert len(numeric) == 6
    assert not any("frozen" in n for n, _ in rows.named_parameters())
    # the twin: another element's gradient is not this difference (the check can fail)
    assert float(rows.k_1.grad[0, 2, 3]) != pytest.approx(numeric["k_1"], rel=1e-3)


# -- exactness against the corpus in context ------------------------------------------------
def test_rows_of_the_corpus_with_no_training_read_as_the_corpus_in_context():
    """p rows from the prefill of the corpus's first p tokens, untrained: a prompt read after
    them gives the logits of the same prompt read after those p tokens in context (prefill,
    then the prompt at position p, its BOS being row 0), bit for bit in the engine's f32
    numerics; the whole sequence in one call agrees to rounding. Twins: rows of another text,
    and the prompt's own BOS read again after the rows, both differ."""
    model = tiny_gemma_torch()
    prefix = [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]
    p = len(prefix)
    prompt = [1, 50, 51, 52, 53, 54]
    with torch.no_grad():
        in_context = seeded_and_in_context(model, prefix, prompt)
        student = CartridgeModel(model, *prefill_rows(model, prefix), bos_id=1)
        seeded = student.logits(student.hidden(torch.tensor([prompt]), 0,
                                               student.new_cache(1, len(prompt))))
        whole = model.logits(model.hidden(torch.tensor([prefix + prompt[1:]])))[:, p:]
        other = CartridgeModel(model, *prefill_rows(model, [1] + [9] * (p - 1)), bos_id=1)
        wrong_text = other.logits(other.hidden(torch.tensor([prompt]), 0,
                                               other.new_cache(1, len(prompt))))
        unmapped = CartridgeModel(model, *prefill_rows(model, prefix), bos_id=None)
        bos_again = unmapped.logits(unmapped.hidden(torch.tensor([prompt]), 0,
                                                    unmapped.new_cache(1, len(prompt))))
    assert torch.equal(seeded, in_context)
    torch.testing.assert_close(seeded, whole, rtol=1e-5, atol=1e-5)
    assert (wrong_text - in_context).abs().max() > 1e-2
    assert (bos_again[:, 1:] - in_context).abs().max() > 0.01


def seeded_and_in_context(model, prefix: list[int], prompt: list[int]) -> torch.Tensor:
    """The logits of `prompt` (without its BOS) read after `prefix` in context: the prefix
    prefilled, then the prompt from position len(prefix)."""
    cache = model.new_cache(1, len(prefix) + len(prompt))
    model.hidden(torch.tensor([prefix]), 0, cache)
    return model.logits(model.hidden(torch.tensor([prompt[1:]]), len(prefix), cache))


class DigitsTokenizer:
    """The surface engine.llm.generate reads: ids decode to their numbers."""

    bos_id, eos_id, eot_ids = 1, 2, ()

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def test_greedy_generation_with_the_cartridge_is_the_in_context_continuation():
    """engine.llm.generate over the CartridgeModel (the path generate / chat / serve take)
    yields the tokens, and their log-probs, that stepping the base after the real prefix
    yields; without the rows the log-probs differ."""
    from engine.llm.generate import generate

    model = tiny_gemma_torch()
    prefix, prompt = [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 50, 51, 52]
    student = CartridgeModel(model, *prefill_rows(model, prefix), bos_id=1)

    def tokens_and_logprobs(generating_model) -> list[tuple[int, float]]:
        events = []
        generate(generating_model, DigitsTokenizer(), prompt, max_new_tokens=8, stop_ids=[],
                 on_token=events.append)
        return [(e.id, e.logprob) for e in events]

    with torch.no_grad():
        cache = model.new_cache(1, len(prefix) + len(prompt) + 8)
        model.hidden(torch.tensor([prefix]), 0, cache)
        ids, pos, want = prompt[1:], len(prefix), []
        for _ in range(8):
            logits = model.logits(model.hidden(torch.tensor([ids]), pos, cache)[:, -1])[0]
            pos += len(ids)
            ids = [int(logits.argmax())]
            want.append((ids[0], float(torch.log_softmax(logits.float(), -1)[ids[0]])))
    assert tokens_and_logprobs(student) == want
    without = tokens_and_logprobs(model)
    assert max(abs(a[1] - b[1]) for a, b in zip(without, want)) > 1e-3


@pytest.mark.realmodel
def test_gemma_270m_reads_untrained_rows_as_the_document_in_llamacpp_numerics(gemma_gguf):
    """The real base in llama.cpp numerics (f16 cache, the C forward that generate and chat
    use): rows from the prefill of the framed corpus's first 64 tokens give a chat prompt the
    logits it gets after those tokens in context, bit for bit; rows of another text do not."""
    from engine.cartridge.self_study import prompt_ids
    from engine.llm.chat import ChatTemplate
    from engine.models.gguf_model import load_gguf_model
    from engine.train.lm_base import Base

    model, tok = load_gguf_model(gemma_gguf, numerics="llamacpp", weights="dense-cache")
    base = Base(model, tok, ChatTemplate.from_gguf(model.gguf), gemma_gguf, dense=False)
    prefix = context_ids(tok, CORPUS)[:64]
    prompt = prompt_ids(base, "What does a run folder hold?")
    with torch.no_grad():
        in_context = seeded_and_in_context(model, prefix, prompt)
        student = attach_rows(model, prefix, tok)
        seeded = student.logits(student.hidden(torch.tensor([prompt]), 0,
                                               student.new_cache(1, len(prompt))))
        other = attach_rows(model, context_ids(tok, "Pirates sail the sea. " * 20)[:64], tok)
        wrong = other.logits(other.hidden(torch.tensor([prompt]), 0,
                                          other.new_cache(1, len(prompt))))
    assert torch.equal(seeded, in_context)
    assert (wrong - in_context).abs().max() > 0.1


def attach_rows(model, prefix: list[int], tok) -> CartridgeModel:
    return CartridgeModel(model, *prefill_rows(model, prefix), bos_id=tok.bos_id)


# -- the file -------------------------------------------------------------------------------
def test_a_cartridge_for_another_base_is_refused(tmp_path, tiny_gemma):
    """The file round-trips rows and metadata; loading it for a base of another SHA-256 is a
    ForgebenchError naming the file, --cartridge and both hashes; its own base loads it."""
    from engine.fsutil import sha256_file
    from engine.models.gguf_model import load_gguf_model

    model, tok = load_gguf_model(tiny_gemma, numerics="f32", weights="packed")
    keys, values = prefill_rows(model, context_ids(tok, CORPUS)[:8])
    path = tmp_path / "c.safetensors"
    meta = {"base_sha256": sha256_file(tiny_gemma), "base_name": tiny_gemma.name, "tokens": 8,
            "leading_bos": True}
    path.write_bytes(cartridge_bytes(keys, values, meta))
    back = read_cartridge(path)
    assert back.meta == meta and back.tokens == 8
    assert all(torch.equal(a, b) for a, b in zip(back.keys + back.values, keys + values))
    assert attach_cartridge(model, tok, path).tokens == 8
    with pytest.raises(ForgebenchError, match="trained on another base model") as info:
        load_cartridge(path, "0" * 64)
    text = info.value.render()
    assert str(path) in text and "--cartridge" in text and meta["base_sha256"][:12] in text
    assert tiny_gemma.name in text
    plain = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(ForgebenchError, match="not a cartridge"):
        read_cartridge(plain)


def test_answer_logprobs_are_the_next_token_distributions_of_a_plain_forward():
    """The one function behind the teacher's top-k, the loss and the reference log-likelihood:
    row j is log softmax of the logits that predict answer token j."""
    model = tiny_gemma_torch()
    prompt, answer = [1, 5, 6, 7], [8, 9, 10]
    got = answer_logprobs(model, prompt, answer)
    full = torch.log_softmax(model(torch.tensor([prompt + answer])), -1)[0]
    torch.testing.assert_close(got, full[len(prompt) - 1:-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, full[len(prompt):], atol=1e-3)


# -- a real run -----------------------------------------------------------------------------
def write_run_config(folder: Path, gguf: Path, steps: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(CORPUS)
    (folder / "questions.jsonl").write_text(json.dumps(
        {"question": "What does a run folder hold?",
         "answer": "run.json, metrics.jsonl and its checkpoints."}) + "\n")
    path = folder / "cartridge.toml"
    path.write_text(CONFIG.format(steps=steps, gguf=gguf))
    return path


def train_rows(run: Path) -> list[dict]:
    return [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if m.get("split") == "train"]


@pytest.mark.slow
def test_a_run_trains_the_rows_resumes_bit_exactly_and_serves(tmp_path, tiny_gemma):
    """A real `forgebench run`: self-study data, a trained cartridge, the held-out comparison of
    the three systems; a run stopped after step 2 and resumed ends with the same losses and
    rows, bit for bit; the run answers in `generate RUN`, serve-local and the Chat pane's
    list; `generate --model OTHER --cartridge` is refused with the reason."""
    from engine.fsutil import sha256_file

    straight = tmp_path / "a"             # a workspace: the run in runs/, the base in models/
    forgebench("run", str(write_run_config(straight, tiny_gemma)), "--out",
               str(straight / "runs" / "cart"))
    split = tmp_path / "b"
    forgebench("run", str(write_run_config(split, tiny_gemma)), "--out", str(split / "run"),
               "--stop-after-step", "2")
    assert json.loads((split / "run" / "status.json").read_text())["step"] == 2
    forgebench("resume", str(split / "run"))

    run = straight / "runs" / "cart"
    a, b = train_rows(run), train_rows(split / "run")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 4
    assert all(r["grad_norm"] > 0 for r in a)
    file = "checkpoints/step-000004/cartridge.safetensors"
    ca, cb = read_cartridge(run / file), read_cartridge(split / "run" / file)
    assert ca.meta == cb.meta
    assert all(torch.equal(x, y) for x, y in zip(ca.keys + ca.values, cb.keys + cb.values))
    first = read_cartridge(run / "checkpoints/step-000002/cartridge.safetensors")
    assert not torch.equal(first.keys[5], ca.keys[5])          # the global layer's rows moved
    assert torch.equal(first.keys[0][:, :1], ca.keys[0][:, :1])  # the frozen BOS row did not
    assert ca.meta["base_sha256"] == sha256_file(tiny_gemma) and ca.meta["tokens"] == 16

    report = json.loads((run / "evals" / "cartridge-step-000004.json").read_text())
    systems = report["systems"]
    assert set(systems) == {"no document", "whole document", "cartridge"}
    assert systems["cartridge"]["kv_prefix_tokens"] == 16
    assert systems["whole document"]["kv_prefix_tokens"] > 16
    assert [q["source"] for q in report["questions"]][0] == "hand-written"
    assert len(report["questions"]) == 2
    assert (run / "evals" / "cartridge-step-000004.md").is_file()
    from engine.cartridge.self_study import answer_f1

    for row in report["questions"]:            # answer quality: each answer's F1, as scored
        for system in systems:
            assert row[system]["answer_f1"] == answer_f1(row[system]["answer"],
                                                         row["reference"])
    mean = sum(row["cartridge"]["answer_f1"] for row in report["questions"]) / 2
    assert systems["cartridge"]["answer_f1"] == pytest.approx(mean)
    assert "| answer F1 |" in (run / "evals" / "cartridge-step-000004.md").read_text()

    out = forgebench("generate", str(run), "--prompt", "hi", "--max-tokens", "3",
                     "--json")
    assert json.loads(out.stdout)["checkpoint"] == "step-000004"
    from engine.serve_local import load_system

    system = load_system("A", {"run": str(run), "checkpoint": "latest"})
    assert isinstance(system.model, CartridgeModel) and system.info["recipe"] == "lm-cartridge"
    from app.viewmodels.chat import sources
    from engine import model_library
    from engine.server.catalog import workspace_entries

    (straight / "workspace.json").write_text(json.dumps({"format": 1, "name": "cartridge"}))
    model_library.add_model(straight, tiny_gemma, mode="link")
    assert "run: cart/step-000004" in [s.label for s in sources(straight) if s.usable]
    catalog = {e.id: e for e in workspace_entries(straight)}
    assert catalog["cart"].load["run"] == str(run) and "lm-cartridge" in catalog["cart"].origin

    from fixtures_gguf import write_tiny_gguf

    other = write_tiny_gguf(tmp_path / "other.gguf", arch="gemma3", seed=1,
                            context_length=2048)
    refused = forgebench("generate", "--model", str(other), "--cartridge",
                         str(run / file), "--prompt", "hi", check=False)
    assert refused.returncode != 0
    assert "trained on another base model" in refused.stderr and "--cartridge" in refused.stderr
    served = forgebench("generate", "--model", str(tiny_gemma), "--cartridge",
                        str(run / file), "--prompt", "hi", "--max-tokens", "2",
                        "--json")
    assert json.loads(served.stdout.splitlines()[-1])["cartridge"].endswith("cartridge.safetensors")


def test_bad_held_out_questions_are_refused_before_a_run_exists(tmp_path, tiny_gemma):
    config = write_run_config(tmp_path, tiny_gemma)
    (tmp_path / "questions.jsonl").write_text('{"question": "q", "answer": ""}\n')
    result = forgebench("run", str(config), "--out", str(tmp_path / "run"), check=False)
    assert result.returncode != 0
    assert "questions.jsonl: line 1" in result.stderr and "'answer'" in result.stderr
    assert not (tmp_path / "run").exists()


# -- PEFT's cartridge adapter as an independent check ---------------------------------------
@pytest.mark.peft
def test_peft_cartridge_adapter_reads_a_prompt_as_the_engine_does(tmp_path):
    """A tiny random Gemma 3 checkpoint in transformers: PEFT's CARTRIDGE adapter initialised
    from transformers' own prefill of the prefix (`initialize_kv_prefix_from_past_key_values`)
    and the engine's CartridgeModel with rows from the engine's prefill give the same logits
    for a prompt read after them (positions p onward in both), within f32 tolerance. Twin: the
    adapter holding rows of another text does not."""
    peft = pytest.importorskip("peft")
    if "CARTRIDGE" not in peft.PeftType.__members__:
        pytest.skip(f"peft {peft.__version__} has no CARTRIDGE adapter type")
    from hf_fixtures import make_checkpoint
    from peft.tuners.cartridge.utils import initialize_kv_prefix_from_past_key_values
    from transformers import Gemma3ForCausalLM

    from engine.models.gguf_model import load_gguf_model

    folder = make_checkpoint("gemma3", tmp_path / "hf", dtype="float32")
    model, tok = load_gguf_model(folder, numerics="f32", weights="packed")
    prefix = [tok.bos_id] + tok.encode("the model trains on data and learns small weights",
                                       add_special=False)
    other = [tok.bos_id] + tok.encode("quick brown fox jumps over the lazy dog runs fast",
                                      add_special=False)[:len(prefix) - 1]
    prompt = tok.encode("attention query key value", add_special=False)
    p = len(prefix)

    def peft_logits(rows_from: list[int]) -> torch.Tensor:
        hf = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        adapted = peft.get_peft_model(hf, peft.CartridgeConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=p, num_frozen_tokens=1))
        with torch.no_grad(), adapted.disable_adapter():
            cache = hf(input_ids=torch.tensor([rows_from]), use_cache=True).past_key_values
        initialize_kv_prefix_from_past_key_values(adapted, past_key_values=cache)
        with torch.no_grad():
            return adapted(input_ids=torch.tensor([prompt])).logits

    with torch.no_grad():
        engine = CartridgeModel(model, *prefill_rows(model, prefix), bos_id=tok.bos_id)
        mine = engine.logits(engine.hidden(torch.tensor([[tok.bos_id] + prompt]), 0,
                                           engine.new_cache(1, len(prompt) + 1)))
    theirs = peft_logits(prefix)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(mine, peft_logits(other), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_stop_during_self_study_keeps_the_conversations_made(tmp_path, tiny_gemma):
    """A stop asked while synthesising saves the conversations made so far; the next call goes
    on from them (the same first ones, the rest made afresh) to the number asked; a cache made
    with other settings is made again."""
    import types

    from engine.cartridge.self_study import load_conversations
    from engine.config import load_config
    from engine.recipes.lm_cartridge import SELF_STUDY_FILE, self_study_data
    from engine.rundir import RunDir
    from engine.train.lm_base import load_base

    config = load_config(write_run_config(tmp_path, tiny_gemma))
    base = load_base(config)
    corpus = base.tokenizer.encode(CORPUS, add_special=False)
    (tmp_path / "run").mkdir()
    job = types.SimpleNamespace(config=config, run=RunDir(tmp_path / "run"),
                                stop_requested=False)
    announced = []

    def announce(stage, detail):          # the stop arrives while conversation 2 is made
        announced.append(detail)
        job.stop_requested = len(announced) == 2

    job.announce = announce
    stopped = self_study_data(job, base, base.model, corpus, "key-a")
    assert len(stopped) == 2
    saved, meta = load_conversations(tmp_path / "run" / SELF_STUDY_FILE)
    assert meta == {"key": "key-a"} and [c.answer_ids for c in saved] == \
        [c.answer_ids for c in stopped]
    job.stop_requested, job.announce = False, lambda stage, detail: None
    resumed = self_study_data(job, base, base.model, corpus, "key-a")
    assert len(resumed) == 5 and [c.record() for c in resumed[:2]] == \
        [c.record() for c in stopped]
    assert all(torch.equal(a.topk_logprobs, b.topk_logprobs)
               for a, b in zip(resumed, stopped))
    remade = self_study_data(job, base, base.model, corpus, "key-b")
    assert len(remade) == 5
    assert "self_study_discarded" in (tmp_path / "run" / "events.jsonl").read_text()


def test_answer_quality_is_the_token_f1_against_the_reference():
    from engine.cartridge.self_study import answer_f1

    reference = "The queue is kept in runs/.launch/queue.json and survives restarts."
    # 9 words said, all among the reference's 12: precision 1, recall 3/4, F1 6/7
    assert answer_f1("The queue is kept in runs/.launch/queue.json", reference) == \
        pytest.approx(6 / 7)
    assert answer_f1(reference.upper(), reference) == 1.0      # case and punctuation aside
    # twins: nothing in common, or nothing said, scores 0
    assert answer_f1("Stop checkpoints, then exits.", reference) == 0.0
    assert answer_f1("", reference) == 0.0
