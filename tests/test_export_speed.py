"""What the export does once instead of several times gives the numbers doing it each time gave:
the report's comparisons of several stage pairs in one pass (equivalence.compare_many) against
compare() of each pair; question 2's f32 answers read off a draft's guesses (quality._answers)
against token-by-token decoding; a file parsed once per export (bundle._parsed_once) against
a fresh parse after it changes. Each with a twin that shows the check can fail."""

from __future__ import annotations

import os

import pytest
import torch
from fixtures_gguf import write_tiny_gguf
from safetensors.torch import save_file

from engine.export import bundle, quality
from engine.export.equivalence import StageResult, _load_engine, _Runner, compare, compare_many


def _stage(path, logits: list[torch.Tensor]) -> StageResult:
    save_file({f"logits.{i}": t for i, t in enumerate(logits)}, str(path))
    return StageResult(path, [], [], [[] for _ in logits])


def test_comparing_pairs_in_one_pass_gives_each_pair_its_own_numbers(tmp_path):
    generator = torch.Generator().manual_seed(0)
    rows = [(3, 50), (5, 50)]                       # two prompts, [positions, vocabulary]
    base = [torch.randn(*shape, generator=generator) for shape in rows]
    stages = [_stage(tmp_path / f"s{k}.st", [t + 0.3 * k * torch.randn(*t.shape,
                                                                       generator=generator)
                                             for t in base]) for k in range(4)]
    ref, merged, quantized, cpp = stages
    pairs = [(ref, merged), (ref, quantized), (merged, quantized), (ref, cpp), (quantized, cpp)]
    together = compare_many(pairs, len(rows))
    one_by_one = [compare(a, b, len(rows)) for a, b in pairs]
    assert together == one_by_one                    # bit for bit: the same operations
    # the twin: the pairs really differ, so equal lists above are not one pair's numbers copied
    assert len({m["kl_mean"] for m in together}) == len(pairs)
    assert together[0] != compare(merged, ref, len(rows))     # KL is not symmetric


class _WrongDraft:
    """A draft that guesses token 7 forever: only work, never an answer, may come from it."""

    stops: set = set()

    def decode(self, prompt, n):
        return [7] * n


@pytest.mark.parametrize("draft_kind", ["same file, native", "wrong tokens"])
def test_question2s_answers_follow_a_draft_to_the_answers_decoding_gives(tmp_path, draft_kind):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0")
    model = {"kind": "gguf", "path": str(path), "numerics": "f32"}
    runner = _Runner(*_load_engine(model)[:2])
    prompts = [runner.tok.encode(text) for text in ("the sea and", "ship", "a")]
    decoded = quality._answers(runner, prompts, str)           # token by token
    if draft_kind == "same file, native":
        draft = quality._native_draft(model)
        if draft is None:
            pytest.skip("the native kernels (the draft) cannot be built here")
    else:
        draft = _WrongDraft()
        # the twin: this draft's own answers are not the model's
        assert [str(draft.decode(p, quality.ANSWER_TOKENS)) for p in prompts] != decoded
    assert quality._answers(_Runner(*_load_engine(model)[:2]), prompts, str, draft) == decoded


def test_decoding_prompts_together_gives_each_prompt_the_tokens_it_gets_alone(tmp_path,
                                                                             monkeypatch):
    from engine.models import native_forward

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0")
    model = {"kind": "gguf", "path": str(path), "numerics": "llamacpp"}
    runner = _Runner(*_load_engine(model)[:2])
    if native_forward.native_decoder(runner.net) is None:
        pytest.skip("the native kernels cannot be built here")
    prompts = [runner.tok.encode(text) for text in ("the sea and", "ship", "a")]
    items = [(p, n) for p, n in zip(prompts, (12, 5, 9))]
    alone = [_Runner(*_load_engine(model)[:2]).decode(p, n) for p, n in items]
    steps = []
    real = native_forward.decode_batch
    monkeypatch.setattr(native_forward, "decode_batch",
                        lambda net, tokens, *a: steps.append(len(tokens)) or real(net, tokens, *a))
    assert runner.decode_many(items) == alone
    assert steps[0] == len(items) and len(steps) == 11       # they stepped together
    assert runner.decode_many(items) == alone and len(steps) == 11    # asked again: kept
    # the twin: each prompt's answer differs from the others', so a row given to the wrong
    # sequence (or one answer copied to all) would fail the equality above
    assert len({tuple(a[:5]) for a in alone}) == len(alone)


def test_a_model_under_llamacpp_numerics_gets_no_draft(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0")
    # it decodes token by token, as llama.cpp serves an answer
    assert quality._native_draft({"kind": "gguf", "path": str(path),
                                  "numerics": "llamacpp"}) is None


def test_an_export_parses_each_file_once_and_again_after_it_changes(tmp_path, monkeypatch):
    import engine.gguf.reader as reader

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gemma3", qtype="Q8_0")
    parses = []
    real = reader.open_gguf
    monkeypatch.setattr(reader, "open_gguf", lambda p: parses.append(p) or real(p))
    with bundle._parsed_once():
        first = bundle._file_dtype(path), bundle._holds_quantized(path)
        assert len(parses) == 1
        write_tiny_gguf(path, arch="gemma3", qtype="F16", seed=1)   # rewritten: parsed again
        os.utime(path, ns=(1, 1))
        second = bundle._file_dtype(path), bundle._holds_quantized(path)
        assert len(parses) == 2
    assert first[1] is True and second[1] is False     # the new file's answer, not the cached
    # the twin: outside an export nothing is kept, every call parses
    bundle._holds_quantized(path)
    bundle._holds_quantized(path)
    assert len(parses) == 4


def test_an_export_hashes_each_file_once_and_again_after_it_changes(tmp_path, monkeypatch):
    import hashlib

    path = tmp_path / "model.gguf"
    path.write_bytes(b"first")
    hashed = []
    real = bundle.sha256_file
    monkeypatch.setattr(bundle, "sha256_file", lambda p: hashed.append(p) or real(p))
    with bundle._parsed_once():
        report_hash = bundle._sha256(path)
        sums = bundle.write_sha256sums(tmp_path).read_text()
        assert len(hashed) == 1 and sums == f"{report_hash}  model.gguf\n"
        path.write_bytes(b"second, longer")                   # rewritten: hashed again
        assert bundle._sha256(path) == hashlib.sha256(b"second, longer").hexdigest()
        assert len(hashed) == 2
    assert report_hash == hashlib.sha256(b"first").hexdigest()
    # the twin: outside an export nothing is kept, every call hashes
    bundle._sha256(path)
    bundle._sha256(path)
    assert len(hashed) == 4


@pytest.mark.llamacpp
def test_the_llamacpp_worker_batches_on_its_own_threads_and_they_change_no_logit(
        tmp_path, monkeypatch):
    from engine.export import equivalence, llamacpp

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", qtype="Q8_0")
    opened = []
    real = llamacpp.open_llama

    def recording(*args, **kwargs):
        llm = real(*args, **kwargs)
        opened.append(llm.context_params.n_threads_batch)
        return llm

    monkeypatch.setattr(llamacpp, "open_llama", recording)
    spec = {"model": {"kind": "llamacpp", "path": str(path)}, "texts": ["the sea and"],
            "sequences": [[1, 5, 9, 13, 20, 21, 22]], "scored_from": [3], "greedy_tokens": 4}
    one = equivalence._llamacpp_worker(dict(spec, threads=1))
    two = equivalence._llamacpp_worker(dict(spec, threads=2))
    # llama-cpp-python's own default is every core; the worker asks for its share
    assert opened == [1, 2]
    assert one["greedy"] == two["greedy"]
    assert all((a == b).all() for a, b in zip(one["logits"], two["logits"]))


def equivalence_root():
    from engine.export.equivalence import REPO_ROOT

    return REPO_ROOT


GATED_WORKER = ("import sys; from engine.export.equivalence import wait_at_gate; "
                "wait_at_gate({'gated': True}); print('measured')")


def _gated_worker(tmp_path):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", GATED_WORKER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(equivalence_root())))


@pytest.mark.parametrize("settle", ["open", "cancel"])
def test_a_worker_started_early_goes_on_only_when_its_files_are_written(tmp_path, settle):
    """Question 2's worker starts after the merge and waits at a gate for the exported file:
    opened, it goes on (measures); cancelled (the export failed), it stops without a result."""
    import threading

    from engine.export.equivalence import GATE_OPEN, Gate

    gate = Gate()
    process = _gated_worker(tmp_path)
    gate.attach(process)

    def tell() -> None:                        # what _run_worker's thread writes
        process.stdin.write(GATE_OPEN + "\n" if gate.wait() else "\n")
        process.stdin.close()

    threading.Thread(target=tell, daemon=True).start()
    assert process.poll() is None              # held at the gate until it is settled
    getattr(gate, settle)()
    gate.open() if settle == "cancel" else gate.cancel()       # a gate settles once
    out = process.stdout.read()
    process.wait(timeout=60)
    if settle == "open":
        assert gate.opened is True and process.returncode == 0 and out.strip() == "measured"
    else:
        assert gate.opened is False and process.returncode != 0 and out == ""


def test_an_ungated_worker_does_not_wait(tmp_path):
    import subprocess
    import sys

    # the twin: without "gated" in its spec the worker reads nothing and goes straight on
    done = subprocess.run([sys.executable, "-c", GATED_WORKER.replace("True", "False")],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(equivalence_root())))
    assert done.returncode == 0 and done.stdout.strip() == "measured"


def test_a_gate_left_unopened_at_the_end_of_its_block_is_cancelled():
    from engine.export.equivalence import Gate

    with Gate() as gate:                     # e.g. the engine worker failed before its answers
        pass
    assert gate.wait() is False
    # the twin: a gate opened within its block stays open
    with Gate() as gate:
        gate.open()
    assert gate.wait() is True
