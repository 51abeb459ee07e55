"""The staged equivalence report: does the exported model answer as the trained one does?

On a fixed prompt suite, each stage is loaded back from its file on disk and scored on the same
token sequences (each prompt followed by the training checkpoint's greedy answer):

1. `checkpoint` — the training checkpoint as the recipe loads it (base + adapter for LoRA runs);
2. `merged`     — the dense GGUF (adapters folded in, or the lm-pretrain model as written);
3. `quantized`  — the quantized GGUF, when the export is quantized;
4. `llama.cpp`  — the exported file (or base + GGUF LoRA) in llama.cpp, when llama-cpp-python
   is installed.

Per stage: top-1 agreement, max and mean |Δlogit| and KL(reference ‖ stage) against the
checkpoint and against the previous stage, whether its own greedy continuation matches the
checkpoint's, and whether its tokenizer gives the same prompt ids. The checkpoint and the dense
stages run with f32 arithmetic, so their differences are the weights' (merge rounding, f16). The
quantized stage runs under llama.cpp numerics on the native kernels (the packed bytes, quantized
activations, f16 KV cache: what llama.cpp computes on that file), so its difference from the
previous stage is the quantization as llama.cpp serves it, and the llama.cpp stage, compared
with the engine on the same file, checks that the engine reproduces the runtime.

The engine stages run one after another in one worker process (`python -m
engine.export.equivalence SPEC.json`), each loading its own file and freed before the next;
llama.cpp runs in a second worker, started as soon as the engine worker has rendered the prompts:
its own greedy answers need nothing else, and it waits at a `Gate` for the checkpoint's answers
before scoring them. Workers write logits and greedy ids to safetensors files,
which the parent compares one prompt at a time, and their wall and CPU seconds (report
`timings`). The checkpoint's greedy answers are found by speculative scoring: the exported file
under the native kernels (the draft) answers each prompt, the checkpoint scores prompt + that
answer in one batch and keeps its own argmax along it (`follow_guesses`, over `greedy_along`),
and where it leaves the draft's answer the draft guesses on from the checkpoint's tokens. The
draft only saves work: every token is the checkpoint's own choice, read off its batched logits
as the f32 stages read theirs. Stages under llama.cpp numerics, and llama.cpp itself, decode
token by token, as llama.cpp serves an answer; the engine decodes its prompts side by side
(`_Runner.decode_many`: one step reads the weights once for all of them, each row summed by the
one-token kernels, so each prompt gets the tokens it gets alone).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.errors import ForgebenchError
from engine.export.llamacpp import open_note

# A fixed suite: plain continuations and instructions, short enough for tiny models' contexts.
PROMPT_SUITE = (
    "Record item",
    "The weather today is",
    "What is the capital of France?",
    "Tell me about the sea.",
    "Write one sentence about a ship.",
    "1, 2, 3,",
)
GREEDY_TOKENS = 32
# A stage passes when its tokenizer agrees and its top-1 next-token choice matches the
# checkpoint on at least this share of positions. Dense stages only round weights to f16 or merge
# in f32, so nearly every choice must survive; a quantized file loses more at near-ties.
MIN_TOP1_DENSE = 0.99
MIN_TOP1_QUANTIZED = 0.90
REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS_FILE = "prompts.json"       # the engine worker's reference prompts (texts and ids)
ANSWERS_FILE = "answers.json"       # the reference's greedy answers, for the llama.cpp worker


@dataclass
class Stage:
    """One thing to load and score: `model` is the worker's load spec."""
    name: str
    description: str
    model: dict
    file: str | None = None
    min_top1: float = MIN_TOP1_DENSE


def verdict(entry: dict, min_top1: float) -> dict:
    """The pass/fail fields a stage's entry in the report carries."""
    passed = bool(entry["tokenizer_matches"]) \
        and entry["vs_checkpoint"]["top1_agreement"] >= min_top1
    return {"min_top1": min_top1, "passed": passed}


@dataclass
class Report:
    prompts: list[dict]
    stages: list[dict] = field(default_factory=list)
    llamacpp: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        # here, not at the top: the llama.cpp worker imports this module and needs neither
        # the CPU plan nor the gguf package it reads layouts from
        from engine.kernels.cpu import plan

        checked = [s["passed"] for s in self.stages if "passed" in s]
        if self.llamacpp.get("available"):
            checked.append(self.llamacpp["passed"])
        return {"prompt_suite": self.prompts, "stages": self.stages, "llamacpp": self.llamacpp,
                "passed": bool(checked) and all(checked), "numerics": plan().summary()}


# ----------------------------------------------------------------------- the worker (child)

def stopwatch() -> Callable[[], dict]:
    """Started now; each call returns {"wall_s", "cpu_s"} since then (this process's CPU, all
    its threads)."""
    import time

    wall, cpu = time.perf_counter(), time.process_time()
    return lambda: {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}



def _load_engine(model: dict):
    """(model, tokenizer, prompt encoder) for a checkpoint or a GGUF file, in eval mode."""
    if model["kind"] == "run":
        from engine.jobs import recipe_module
        from engine.rundir import RunDir

        run = RunDir(model["run"]).require()
        checkpoint = run.checkpoint(model["checkpoint"])
        recipe = run.manifest()["recipe"]
        if recipe == "lm-pretrain":
            net, tok, _ = recipe_module(recipe).load_model(run, checkpoint)
            from engine.train.lm_base import PretrainTokenizer
            tok = PretrainTokenizer(tok)
            render = lambda prompt: prompt                                   # noqa: E731
        else:
            base, config = recipe_module(recipe).load_trained(run, checkpoint)
            net, tok = base.model, base.tokenizer
            render = lambda prompt: base.template.render(                    # noqa: E731
                [{"role": "user", "content": prompt}],
                enable_thinking=config.data.enable_thinking)
        return net.eval(), tok, render
    from engine.models.gguf_model import load_gguf_model

    numerics = model.get("numerics", "f32")
    # f32: dequantized once, for many forwards; llama.cpp numerics: the packed bytes the native
    # kernels read
    net, tok = load_gguf_model(model["path"], numerics=numerics,
                               weights="packed" if numerics == "llamacpp" else "dense-cache")
    if model.get("lora"):
        from engine.lora import attach_adapter_file
        attach_adapter_file(net, model["lora"])
    return net.eval(), tok, None


def _stop_ids(tok) -> set[int]:
    return {i for i in (tok.eos_id, *getattr(tok, "eot_ids", ())) if i is not None}


def greedy_along(scored, answer: list[int], limit: int, stops: set[int]) -> tuple[list[int], bool]:
    """A stage's greedy answer read off its logits on the reference's sequence: `scored` row j
    [V] follows the prompt and `answer[:j]`. While the stage's argmax picks the reference's next
    token its greedy chain walks the same sequence, so no token-by-token decoding is needed up
    to the first disagreement. Returns (tokens, finished); unfinished means the chain left the
    reference's answer and the caller decodes on from the last token."""
    import torch

    out: list[int] = []
    while len(out) < limit:
        token = int(torch.argmax(scored[len(out)]))
        if token in stops:
            break
        out.append(token)
        if len(out) > len(answer) or token != answer[len(out) - 1]:
            return out, False
    return out, True


class _Runner:
    """A loaded stage model's two ways to run: KV-cached greedy decoding (as a chat serves an
    answer) and scoring a whole sequence in one batch."""

    def __init__(self, net, tok, render=None):
        self.net, self.tok, self.render = net, tok, render
        self.stops = _stop_ids(tok)
        self._decoded: dict[tuple, list[int]] = {}

    def decode(self, prompt: list[int], n: int) -> list[int]:
        import torch

        from engine.sampling import SamplingSettings, generate_tokens

        key = (tuple(prompt), n)
        if key not in self._decoded:                  # a draft is asked once per prefix
            net = self.net
            cache = net.new_cache(1, len(prompt) + n)

            def step(new_ids: list[int], start_pos: int) -> torch.Tensor:
                h = net.hidden(torch.tensor([new_ids]), start_pos=start_pos, cache=cache)
                return net.logits(h[0, -1]).float()

            self._decoded[key] = generate_tokens(step, list(prompt), max_new_tokens=n,
                                                 settings=SamplingSettings(),
                                                 stop_ids=self.stops)
        return list(self._decoded[key])

    def decode_many(self, items: list[tuple[list[int], int]]) -> list[list[int]]:
        """decode(prompt, n) of each (prompt, n). Under the native kernels the sequences not
        decoded yet advance together, one token each per step (native_forward.decode_batch):
        every weight and the 262k-row LM head are read once per step for all of them instead of
        once per sequence, and each row is summed by the one-token kernels a sequence decoded
        alone gets, so its tokens are decode's. Elsewhere they decode one after another."""
        import torch

        from engine.models.native_forward import decode_batch, native_decoder
        from engine.sampling import SamplingSettings, TokenStream

        todo = list(dict.fromkeys((tuple(prompt), n) for prompt, n in items
                                  if n > 0 and (tuple(prompt), n) not in self._decoded))
        if len(todo) > 1 and native_decoder(self.net) is not None:
            net = self.net
            with torch.no_grad():
                caches = [net.new_cache(1, len(prompt) + n) for prompt, n in todo]
                streams = [TokenStream(list(prompt), max_new_tokens=n,
                                       settings=SamplingSettings(), stop_ids=self.stops)
                           for prompt, n in todo]
                # the prompts as generate_tokens feeds them: each in one forward of its own
                logits = [net.logits(net.hidden(torch.tensor([list(prompt)]), start_pos=0,
                                                cache=cache)[0, -1]).float()
                          for (prompt, _), cache in zip(todo, caches)]
                live = list(range(len(todo)))
                while live:
                    live = [i for i, row in zip(live, logits) if streams[i].take(row)]
                    if live:
                        logits = list(decode_batch(net, [streams[i].out[-1] for i in live],
                                                   [streams[i].position for i in live],
                                                   [caches[i] for i in live]))
            outs = [stream.out for stream in streams]
            for key, out in zip(todo, outs):
                self._decoded[key] = out
        return [self.decode(list(prompt), n) for prompt, n in items]

    def score(self, seq: list[int], start: int):
        """Logit rows [len(seq) - start, V] for the positions from `start` on."""
        import torch

        return self.net.logits(self.net.hidden(torch.tensor([seq]))[0, start:]).float()

    def score_many(self, items: list[tuple[list[int], int]]) -> list:
        """score(seq, start) of each item. Under f32 they are packed into one forward (each
        sequence at positions 0…, attending only within itself, as training packs them): the
        weights are read once for all. The native kernels take one sequence at a time."""
        import torch

        if len(items) <= 1 or getattr(self.net, "numerics", "f32") == "llamacpp":
            return [self.score(seq, start) for seq, start in items]
        lengths = [len(seq) for seq, _ in items]
        keep = torch.zeros(1, sum(lengths), dtype=torch.bool)
        offset = 0
        for (_, start), n in zip(items, lengths):
            keep[0, offset + start:offset + n] = True
            offset += n
        tokens = torch.tensor([[t for seq, _ in items for t in seq]])
        logits = self.net.logits(self.net.hidden(tokens, lengths=lengths, rows=keep)).float()
        return list(torch.split(logits, [n - start for (_, start), n in zip(items, lengths)]))


def decode_all(runner, items: list[tuple[list[int], int]]) -> list[list[int]]:
    """runner.decode(prompt, n) of each item, together where the runner can (_Runner.decode_many;
    a draft need only have `decode`)."""
    if hasattr(runner, "decode_many"):
        return runner.decode_many(items)
    return [runner.decode(prompt, n) for prompt, n in items]


def follow_guesses(stage: _Runner, prompts: list[list[int]], guesses: list[list[int]],
                   scored: list, limit: int,
                   draft: _Runner | None) -> list[tuple[list[int], object]]:
    """The stage's greedy answer to each prompt, read off `scored` (its rows for prompt + guess
    from the prompt's last token) with greedy_along: speculative decoding. Where the stage
    leaves a guess, `draft` guesses on from the stage's own tokens and the stage scores the
    longer sequences again, all prompts still open in one batch (score_many); without a draft it
    decodes on token by token. The draft only saves work: every token kept is the stage's own
    argmax.

    Returns (answer, rows) per prompt: rows are the stage's logits for prompt + answer from the
    prompt's last token, read off the last scoring (causal attention: tokens after the answer
    change no earlier row), or None where the answer was decoded on."""
    answers: list[list[int]] = [[] for _ in prompts]
    results: list = [None] * len(prompts)
    open_ = list(range(len(prompts)))
    guesses, scored = list(guesses), list(scored)
    while open_:
        again = []
        for i in open_:
            answer = answers[i]
            more, finished = greedy_along(scored[i][len(answer):], guesses[i],
                                          limit - len(answer), stage.stops)
            answer += more
            if finished:                      # the answer is a prefix of the scored sequence
                results[i] = (answer, scored[i][:len(answer) + 1])
            elif len(answer) >= limit:        # its last token is the stage's own, not scored
                results[i] = (answer, None)
            elif draft is None:
                results[i] = (answer + stage.decode(prompts[i] + answer, limit - len(answer)),
                              None)
            else:
                again.append(i)
        # the draft guesses on for every prompt still open at once (decode_many)
        for i, guess in zip(again, decode_all(draft,
                [(prompts[i] + answers[i], limit - len(answers[i])) for i in again])
                if again else ()):
            guesses[i] = guess
        for i, rows in zip(again, stage.score_many(
                [(prompts[i] + answers[i] + guesses[i], len(prompts[i]) - 1) for i in again])):
            scored[i] = rows
        open_ = again
    return results


def _score_stage(stage: _Runner, spec: dict, draft: _Runner | None = None,
                 on_prompts: Callable[[list[str], list[list[int]]], None] | None = None) -> dict:
    """One stage's texts, prompt ids, greedy answers and logits (the worker's result).

    The reference (no "sequences" in `spec`) finds its greedy answers and scores them; with a
    draft it scores the draft's answers and follows them (follow_guesses) instead of decoding
    token by token. Every other stage scores the reference's sequences (score_many); an f32 stage
    reads its greedy answer off those logits, a stage under llama.cpp numerics decodes token by
    token, as llama.cpp serves an answer (its one-row kernels sum differently from its batch
    kernels, so a batched read could flip a near-tie that a served answer would not).
    `on_prompts(texts, ids)` is told the rendered prompts and their ids before any scoring."""
    import torch

    from engine.llm.chat import encode_prompt

    limit = spec["greedy_tokens"]
    served = getattr(stage.net, "numerics", "f32") == "llamacpp"
    with torch.no_grad():
        texts = spec["texts"] if "texts" in spec else [stage.render(p) for p in spec["prompts"]]
        ids = [encode_prompt(stage.tok, text) for text in texts]
        if on_prompts is not None:
            on_prompts(list(texts), ids)
        if "sequences" in spec:
            seqs, starts = spec["sequences"], spec["scored_from"]
            prompts = [seq[:start + 1] for seq, start in zip(seqs, starts)]
            logits = stage.score_many(list(zip(seqs, starts)))
            if served:
                greedy = decode_all(stage, [(prompt, limit) for prompt in prompts])
            else:
                greedy = [answer for answer, _ in follow_guesses(
                    stage, prompts, [seq[start + 1:] for seq, start in zip(seqs, starts)],
                    logits, limit, draft)]
        else:
            if draft is not None:
                guesses = decode_all(draft, [(prompt, limit) for prompt in ids])
                followed = follow_guesses(stage, ids, guesses, stage.score_many(
                    [(prompt + guess, len(prompt) - 1) for prompt, guess in zip(ids, guesses)]),
                    limit, draft)
            else:
                followed = [(stage.decode(prompt, limit), None) for prompt in ids]
            greedy = [answer for answer, _ in followed]
            logits = [rows for _, rows in followed]
            missing = [i for i, rows in enumerate(logits) if rows is None]
            for i, rows in zip(missing, stage.score_many(
                    [(ids[i] + greedy[i], len(ids[i]) - 1) for i in missing])):
                logits[i] = rows
    return {"texts": list(texts), "prompt_ids": ids, "greedy": greedy, "logits": logits}


def _draft_runner(model: dict | None) -> _Runner | None:
    """The draft for follow_guesses: the exported file under the native kernels, or None where
    they cannot run it (then stages decode token by token)."""
    if model is None:
        return None
    from engine.models.native_forward import native_decoder

    draft = _Runner(*_load_engine(model)[:2])
    return draft if native_decoder(draft.net) is not None else None


def _engine_worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec.get("threads", 1))
    return _score_stage(_Runner(*_load_engine(spec["model"])), spec,
                        _draft_runner(spec.get("draft")))


def _llamacpp_worker(spec: dict) -> dict:
    """llama.cpp's greedy answers and logits; numpy only (no torch import: a second less).
    The file's BOS flag and stop ids come with the spec (`tokenizer`: tokenizer_facts, from the
    parent's parse of the same file), else from parsing its 262k-token vocabulary here."""
    import numpy as np

    from engine.export.llamacpp import open_llama

    model = spec["model"]
    facts = spec.get("tokenizer") or tokenizer_facts(model["path"])
    limit = spec["greedy_tokens"]
    # room for the longest sequence and a greedy answer after it (started before the
    # reference's answers exist: the longest prompt and two answers of at most `limit` tokens)
    longest = (max(len(s) for s in spec["sequences"]) if "sequences" in spec else
               max(len(p) for p in spec["prompt_ids"]) + limit) + limit + 8
    # n_threads_batch too: llama-cpp-python's default is every core, whose waiting threads spin
    # on cores the engine's workers are using (the batched evals took a third more CPU on 2
    # cores); the logits do not depend on the thread count (_beside_threads)
    threads = spec.get("threads", 1)
    llm = open_llama(model["path"], lora_path=model.get("lora"), n_ctx=max(64, longest),
                     n_batch=512, logits_all=True, n_threads=threads, n_threads_batch=threads,
                     verbose=False, seed=0)
    stops, bos = set(facts["stops"]), facts["bos_id"]
    # the reference's prompt ids: given, or the prompts of the sequences to score
    prompts = spec.get("prompt_ids") or [seq[:start + 1] for seq, start in
                                         zip(spec["sequences"], spec["scored_from"])]
    out: dict = {"texts": spec["texts"], "prompt_ids": [], "greedy": [], "logits": []}
    for text, prompt in zip(spec["texts"], prompts):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if facts["add_bos"] and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        out["prompt_ids"].append(ids)
        # the greedy answer as llama.cpp serves it: the prompt in one batch, then token by token
        # (its one-row kernels sum differently from its batch kernels, so reading the answer off
        # batched logits could flip a near-tie that a served answer would not)
        llm.reset()
        llm.eval(prompt)
        greedy: list[int] = []
        while len(greedy) < limit:
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if token in stops:
                break
            greedy.append(token)
            llm.eval([token])
        out["greedy"].append(greedy)
    # the answers above need only the prompts; the scoring below needs the reference's answers,
    # which a worker started early waits for (the parent writes them to `answers_file`)
    wait_at_gate(spec)
    if "answers_file" in spec:
        answers = json.loads(Path(spec["answers_file"]).read_text("utf-8"))
        spec = {**spec, **reference_sequences(spec["texts"], prompts, answers, limit)}
    for seq, start in zip(spec["sequences"], spec["scored_from"]):
        llm.reset()
        llm.eval(seq)                                   # one batch: prompt and reference answer
        out["logits"].append(np.array(llm.scores[start:len(seq)], dtype=np.float32))
    return out


def tokenizer_facts(tokenizer) -> dict:
    """What the llama.cpp worker needs of a file's tokenizer (a GGUFTokenizer, or a path to
    read one from): its BOS flag and id and its stop ids."""
    if not hasattr(tokenizer, "bos_id"):
        from engine.llm.tokenizer import GGUFTokenizer

        tokenizer = GGUFTokenizer.from_gguf(tokenizer)
    return {"add_bos": bool(tokenizer.add_bos), "bos_id": tokenizer.bos_id,
            "stops": sorted(_stop_ids(tokenizer))}


def _write_result(out: dict, path: Path) -> None:
    """A worker's result; its logits are torch tensors (engine) or numpy arrays (llama.cpp)."""
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {f"logits.{i}": np.ascontiguousarray(t if isinstance(t, np.ndarray) else t.numpy())
               for i, t in enumerate(out["logits"])}
    meta = {k: json.dumps(out.get(k)) for k in ("texts", "prompt_ids", "greedy", "timing")}
    save_file(tensors or {"empty": np.zeros(1, np.float32)}, str(path), metadata=meta)


def reference_sequences(texts: list[str], prompt_ids: list[list[int]], greedy: list[list[int]],
                        greedy_tokens: int) -> dict:
    """What every stage after the reference scores: each prompt followed by the reference's
    greedy answer, from the prompt's last token."""
    return {"texts": texts, "sequences": [p + g for p, g in zip(prompt_ids, greedy)],
            "scored_from": [len(p) - 1 for p in prompt_ids], "greedy_tokens": greedy_tokens}


def _engine_stages_worker(spec: dict) -> None:
    """Every engine stage in one process, one after another: the reference, then each stage on
    the reference's sequences. Each loads its own file and is freed before the next loads; the
    draft (follow_guesses) stays loaded and is itself the stage that names the same load spec.
    Writes `stage-K.safetensors` (0: the reference) into `outdir` and prints `stage K` to stdout
    as each begins, for the parent's progress."""
    import gc

    import torch

    torch.set_num_threads(spec.get("threads", 1))
    outdir = Path(spec["outdir"])
    draft = _draft_runner(spec.get("draft"))

    def prompts_known(texts: list[str], ids: list[list[int]]) -> None:
        """The reference's prompts, for the llama.cpp worker's own greedy answers, which need
        nothing else: written before the reference's scoring and announced ("prompts")."""
        (outdir / PROMPTS_FILE).write_text(json.dumps({"texts": texts, "prompt_ids": ids}),
                                           encoding="utf-8")
        print("prompts", flush=True)

    def run(k: int, model: dict, stage_spec: dict) -> dict:
        print(f"stage {k}", flush=True)
        elapsed = stopwatch()
        stage = draft if draft is not None and model == spec["draft"] else \
            _Runner(*_load_engine(model))
        result = _score_stage(stage, stage_spec, draft, prompts_known if k == 0 else None)
        result["timing"] = elapsed()
        _write_result(result, outdir / f"stage-{k}.safetensors")
        del stage
        gc.collect()
        return result

    # prompts are rendered by the reference (a run's chat template); texts are used as given
    ref = run(0, spec["reference"], {**{k: spec[k] for k in ("prompts", "texts") if k in spec},
                                     "greedy_tokens": spec["greedy_tokens"]})
    common = reference_sequences(ref["texts"], ref["prompt_ids"], ref["greedy"],
                                 spec["greedy_tokens"])
    del ref
    for k, model in enumerate(spec["stages"], start=1):
        run(k, model, common)


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text("utf-8"))
    if spec.get("worker") == "quality":               # engine/export/quality.py
        from engine.export.quality import worker_main as quality_main
        return quality_main(spec_path)
    if "stages" in spec:
        _engine_stages_worker(spec)
        return 0
    runner = _llamacpp_worker if spec["model"]["kind"] == "llamacpp" else _engine_worker
    _write_result(runner(spec), Path(spec["out"]))
    return 0


# ----------------------------------------------------------------------- the parent

@dataclass
class StageResult:
    path: Path
    texts: list[str]
    prompt_ids: list[list[int]]
    greedy: list[list[int]]
    timing: dict | None = None

    @classmethod
    def read(cls, path: Path) -> "StageResult":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
        return cls(path, *(json.loads(meta[k]) for k in ("texts", "prompt_ids", "greedy")),
                   timing=json.loads(meta.get("timing") or "null"))

    def logits(self, i: int):
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(f"logits.{i}").double()


def _beside_threads(threads: int) -> int:
    """Threads for a worker that runs beside another of `threads`: as many where the machine has
    cores for both, else the cores the other leaves (at least one). llama.cpp's threads wait
    for each other at every op, so more threads than free cores cost more than they give; its
    logits do not depend on how many there are (each output row is one thread's sum)."""
    cores = os.cpu_count() or 1
    return threads if cores >= 2 * threads else max(1, cores - threads)


class Gate:
    """Where a worker started before all its files exist waits for them (`wait_at_gate`): the
    parent `open`s it once they are written, or `cancel`s it (the export failed, or the worker
    is not needed after all) and the worker exits without measuring. Either happens once."""

    def __init__(self):
        import threading

        self._event, self._lock = threading.Event(), threading.Lock()
        self.opened: bool | None = None
        self._process = None

    def open(self) -> None:
        self._settle(True)

    def cancel(self) -> None:
        """Stop the worker, at once where it runs (it would measure nothing the export keeps);
        a gate already open stays open."""
        self._settle(False)
        if self.opened is False:
            self._stop()

    def attach(self, process) -> None:
        with self._lock:
            self._process = process
        if self.opened is False:
            self._stop()

    def _stop(self) -> None:
        with self._lock:
            process = self._process
        if process is not None and process.poll() is None:
            process.terminate()

    def _settle(self, opened: bool) -> None:
        with self._lock:
            if self.opened is None:
                self.opened = opened
                self._event.set()

    def wait(self) -> bool:
        self._event.wait()
        return bool(self.opened)

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()                 # never opened by the end of its block: nobody will


GATE_OPEN = "go"


def wait_at_gate(spec: dict) -> None:
    """In a gated worker (_run_worker's `gate`): wait until the parent says its files are on
    disk; exit without a result where it cancels (or is gone)."""
    if spec.get("gated") and sys.stdin.readline().strip() != GATE_OPEN:
        raise SystemExit(3)


def _run_worker(spec: dict, workdir: Path, name: str, threads: int,
                on_line: Callable[[str], None] = lambda _line: None,
                gate: Gate | None = None) -> dict:
    """Run a worker in a fresh Python process, passing each line it prints to `on_line`;
    returns the process's wall and CPU seconds (its own, from wait4: another worker running
    beside it is not counted). With a `gate`, the worker may start before the files it needs
    later exist: it waits for them at wait_at_gate, told through its stdin when the gate opens."""
    import threading
    import time

    spec_path = workdir / f"{name}.json"
    spec_path.write_text(json.dumps(dict(spec, threads=threads, gated=gate is not None)),
                         encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        OMP_NUM_THREADS=str(threads))
    # The workers run side by side on few cores: an OpenMP thread that finds its work done
    # sleeps at once instead of spinning (libgomp's default spins ~300k turns per wait, CPU a
    # worker beside it needed: the engine worker's two threads burnt a third more CPU-seconds
    # spinning). It changes no arithmetic, only how idle threads wait; a caller's own setting
    # is kept.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    wall = time.perf_counter()
    with tempfile.TemporaryFile("w+", encoding="utf-8") as errors:
        process = subprocess.Popen([sys.executable, "-m", "engine.export.equivalence",
                                    str(spec_path)], env=env, stdout=subprocess.PIPE,
                                   stderr=errors, text=True,
                                   stdin=subprocess.PIPE if gate is not None else None)
        if gate is not None:
            gate.attach(process)

            def tell() -> None:
                opened = gate.wait()
                with contextlib.suppress(OSError):       # a worker that has already ended
                    process.stdin.write(GATE_OPEN + "\n" if opened else "\n")
                    process.stdin.close()

            # a daemon: a gate never settled (the parent died) holds no exit
            threading.Thread(target=tell, daemon=True, name=f"forgebench-gate-{name}").start()
        for line in process.stdout:
            on_line(line.strip())
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        stderr = errors.read()
    if returncode != 0:
        raise ForgebenchError(f"equivalence stage '{name}' failed:\n"
                              + (stderr.strip().splitlines() or ["(no output)"])[-1],
                              where=f"stage {name}", hint="see the message above; rerun "
                              "with --no-report to export without the report")
    return {"wall_s": time.perf_counter() - wall, "cpu_s": usage.ru_utime + usage.ru_stime}


def compare(reference: StageResult, other: StageResult, n: int) -> dict:
    """Top-1 agreement, |Δlogit| and KL(reference ‖ other) over every scored position."""
    return compare_many([(reference, other)], n)[0]


def compare_many(pairs: list[tuple[StageResult, StageResult]], n: int) -> list[dict]:
    """compare(reference, other, n) of each pair, in one pass over the prompts: a stage that
    is in several pairs has its logits read and its log-softmax taken once per prompt (the same
    operations on the same values as compare, so the same numbers)."""
    stages = list({id(s): s for pair in pairs for s in pair}.values())
    sums = [{"agree": 0, "positions": 0, "max_abs": 0.0, "sum_abs": 0.0, "count": 0,
             "kl_sum": 0.0, "kl_max": 0.0} for _ in pairs]
    for i in range(n):
        logits = {id(s): s.logits(i) for s in stages}                # [P, V] f64
        log_soft = {key: value.log_softmax(-1) for key, value in logits.items()}
        probs = {id(a): log_soft[id(a)].exp() for a, _ in pairs}
        top1 = {key: value.argmax(-1) for key, value in logits.items()}
        for (a, b), acc in zip(pairs, sums):
            acc["agree"] += int((top1[id(a)] == top1[id(b)]).sum())
            acc["positions"] += logits[id(a)].shape[0]
            diff = (logits[id(a)] - logits[id(b)]).abs()
            acc["max_abs"] = max(acc["max_abs"], float(diff.max()))
            acc["sum_abs"] += float(diff.sum())
            acc["count"] += diff.numel()
            kl = (probs[id(a)] * (log_soft[id(a)] - log_soft[id(b)])).sum(-1)        # [P]
            acc["kl_sum"] += float(kl.sum())
            acc["kl_max"] = max(acc["kl_max"], float(kl.max()))
            del diff, kl
        del logits, log_soft, probs
    return [{"positions": acc["positions"], "top1_agreement": acc["agree"] / acc["positions"],
             "max_abs_logit_diff": acc["max_abs"],
             "mean_abs_logit_diff": acc["sum_abs"] / acc["count"],
             "kl_mean": acc["kl_sum"] / acc["positions"], "kl_max": acc["kl_max"]}
            for acc in sums]


def _greedy_match(reference: StageResult, other: StageResult) -> dict:
    matches, prefix = [], []
    for ref, got in zip(reference.greedy, other.greedy):
        matches.append(ref == got)
        common = 0
        while common < min(len(ref), len(got)) and ref[common] == got[common]:
            common += 1
        prefix.append(common)
    return {"all_match": all(matches), "matches": matches, "common_prefix_tokens": prefix}


def llamacpp_available() -> str | None:
    """None when llama-cpp-python can be imported, else why not."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    return None


def build_report(reference: dict, stages: list[Stage], *, llamacpp: Stage | None,
                 draft: dict | None = None, prompts: tuple[str, ...] = PROMPT_SUITE,
                 greedy_tokens: int = GREEDY_TOKENS, threads: int = 1,
                 decode: Callable[[list[int]], str] | None = None,
                 progress: Callable[[str], None] | None = None,
                 same_file: dict | None = None, llamacpp_tokenizer=None) -> dict:
    """Score the checkpoint (`reference`, a worker load spec) and each stage; return the report.
    `draft` (a load spec: the exported file under llama.cpp numerics) lets the stages follow
    guesses instead of decoding token by token (follow_guesses); it changes no result.
    `same_file` (a load spec: what llama.cpp runs, in the engine under llama.cpp numerics) is
    what the llama.cpp stage is compared with as "vs engine, same file": the last stage where
    it is that, else one more engine pass that is not a stage of its own. `llamacpp_tokenizer`
    (the GGUFTokenizer of the file llama.cpp runs, where the caller has it) spares the llama.cpp
    worker reading it again."""
    say = progress or (lambda _msg: None)
    models = [s.model for s in stages]
    extra = same_file is not None and (not models or models[-1] != same_file)
    if extra:
        models.append(same_file)
    missing = None if llamacpp is None else llamacpp_available()
    # (the gate is cancelled, stopping a llama.cpp worker still waiting at it, before the pool
    # waits for that worker: an engine worker that fails never opens it)
    with tempfile.TemporaryDirectory(prefix="forgebench-equivalence-") as tmp, \
            ThreadPoolExecutor(1, thread_name_prefix="forgebench-llamacpp") as beside, \
            Gate() as cpp_gate:
        workdir = Path(tmp)
        labels = ["checkpoint: greedy answers and scoring"] + [f"{s.name}: scoring"
                                                                for s in stages]
        labels += ["the exported file under llama.cpp numerics: scoring"] if extra else []
        cpp_out, cpp_worker = workdir / "llamacpp.safetensors", []

        def submit_llamacpp(spec: dict, gate: Gate | None) -> None:
            """The llama.cpp worker, in a process of its own beside the engine's (each worker is
            mostly one thread's short ops, so two side by side use a second core that one
            leaves idle)."""
            if llamacpp_tokenizer is not None:
                spec["tokenizer"] = tokenizer_facts(llamacpp_tokenizer)
            cpp_worker.append(beside.submit(_run_worker, spec, workdir, "llamacpp",
                                            _beside_threads(threads), lambda _line: None, gate))

        def start_llamacpp_early() -> None:
            """llama.cpp's own greedy answers need only the reference's prompts: its worker
            starts as soon as the engine worker has rendered them, while the checkpoint's
            answers are still being found, and waits at a gate for those before scoring them."""
            if llamacpp is None or missing is not None or cpp_worker:
                return
            known = json.loads((workdir / PROMPTS_FILE).read_text("utf-8"))
            say("llama.cpp: greedy answers")
            submit_llamacpp({"texts": known["texts"], "prompt_ids": known["prompt_ids"],
                             "greedy_tokens": greedy_tokens, "model": llamacpp.model,
                             "out": str(cpp_out), "answers_file": str(workdir / ANSWERS_FILE)},
                            cpp_gate)

        def start_llamacpp() -> None:
            """Once the reference's answers are on disk: the worker started early goes on to
            score them, or one starts now with them."""
            if llamacpp is None or missing is not None or cpp_gate.opened is not None:
                return
            ref0 = StageResult.read(workdir / "stage-0.safetensors")
            say("llama.cpp: scoring")
            if cpp_worker:
                (workdir / ANSWERS_FILE).write_text(json.dumps(ref0.greedy), encoding="utf-8")
                cpp_gate.open()
                return
            cpp_gate.open()                   # settled: no worker waits at it
            submit_llamacpp(dict(reference_sequences(ref0.texts, ref0.prompt_ids, ref0.greedy,
                                                     greedy_tokens), model=llamacpp.model,
                                 out=str(cpp_out)), None)

        def relay(line: str) -> None:
            if line == "prompts":
                start_llamacpp_early()
            elif line.startswith("stage "):
                k = int(line.split()[1])
                if k >= 1:                    # the worker writes stage K-1 before starting K
                    start_llamacpp()
                say(labels[k])

        timings = {"engine worker": _run_worker(
            {"reference": reference, "prompts": list(prompts), "greedy_tokens": greedy_tokens,
             "stages": models, "draft": draft, "outdir": str(workdir)},
            workdir, "engine", threads, relay)}
        start_llamacpp()                      # no stage after the reference: it starts now
        ref, *got_stages = [StageResult.read(workdir / f"stage-{k}.safetensors")
                            for k in range(len(models) + 1)]
        same = got_stages.pop() if extra else None
        if same is not None:
            timings["engine, same file"] = same.timing
        common = reference_sequences(ref.texts, ref.prompt_ids, ref.greedy, greedy_tokens)
        sequences, scored_from = common["sequences"], common["scored_from"]
        n = len(sequences)
        prompt_rows = [{"prompt": p, "prompt_tokens": len(ids), "answer_tokens": len(g),
                        "answer": decode(g) if decode else None}
                       for p, ids, g in zip(prompts, ref.prompt_ids, ref.greedy)]
        report = Report(prompt_rows)
        report.stages.append({"name": "checkpoint", "description": "training checkpoint "
                              "(reference)", "file": None, "positions":
                              sum(len(s) - f for s, f in zip(sequences, scored_from))})
        timings["checkpoint"] = ref.timing
        # every stage against the checkpoint and against the stage before it, and llama.cpp
        # against the checkpoint and the engine on the same file, in one pass (a stage in
        # several pairs is read and normalised once per prompt: the checkpoint's and the
        # exported file's logits were read twice when llama.cpp's pairs had a pass of their own)
        previous = [ref, *got_stages[:-1]]
        pairs = [(ref, got) for got in got_stages] + [
            (before, got) for before, got in zip(previous, got_stages) if before is not ref]
        staged = len(pairs)
        cpp_timing = cpp_got = engine_same_file = None
        if llamacpp is not None and missing is None:
            cpp_timing = cpp_worker[0].result()
            cpp_got = StageResult.read(cpp_out)
            engine_same_file = same or (got_stages[-1] if got_stages else None)
            pairs += [(ref, cpp_got)] + ([(engine_same_file, cpp_got)]
                                         if engine_same_file is not None else [])
        measured = compare_many(pairs, n)
        vs_checkpoint = measured[:len(got_stages)]
        vs_previous = iter(measured[len(got_stages):staged])
        for stage, got, before, vs_ref in zip(stages, got_stages, previous, vs_checkpoint):
            timings[stage.name] = got.timing
            entry = {
                "name": stage.name, "description": stage.description, "file": stage.file,
                "tokenizer_matches": got.prompt_ids == ref.prompt_ids,
                "vs_checkpoint": vs_ref,
                "vs_previous": vs_ref if before is ref else next(vs_previous),
                "greedy_vs_checkpoint": _greedy_match(ref, got)}
            report.stages.append({**entry, **verdict(entry, stage.min_top1)})
        if llamacpp is None:
            report.llamacpp = {"available": False, "reason": "no llama.cpp stage for this export"}
        elif missing is not None:
            report.llamacpp = {"available": False, "reason": missing}
        else:
            timings["llama.cpp worker"] = cpp_timing
            got, cpp_measured = cpp_got, measured[staged:]
            report.llamacpp = {
                "available": True, "description": llamacpp.description, "file": llamacpp.file,
                "tokenizer_matches": got.prompt_ids == ref.prompt_ids,
                "vs_checkpoint": cpp_measured[0],
                "greedy_vs_checkpoint": _greedy_match(ref, got),
                "answers": [decode(g) if decode else None for g in got.greedy]}
            if (note := open_note()) is not None:         # how llama.cpp opened the file
                report.llamacpp["note"] = note
            report.llamacpp.update(verdict(report.llamacpp, llamacpp.min_top1))
            if engine_same_file is not None:
                report.llamacpp["vs_engine_same_file"] = cpp_measured[1]
                report.llamacpp["greedy_vs_engine_same_file"] = _greedy_match(engine_same_file,
                                                                              got)
    return {**report.as_dict(), "timings": timings}


def _verdict_text(entry: dict) -> str:
    # a stage's check is a diagnostic (where answers move), never a second verdict: the
    # export's one verdict heads the report (engine.export.verdict)
    return (f"  stage check: {'within its bar' if entry['passed'] else 'beyond its bar'} "
            f"(top-1 ≥ {entry['min_top1'] * 100:.0f}% and the same tokenizer)")


def _metrics_row(name: str, m: dict) -> str:
    return (f"  {name:<28} top-1 {m['top1_agreement'] * 100:6.2f}%   max|Δ| "
            f"{m['max_abs_logit_diff']:.4g}   mean|Δ| {m['mean_abs_logit_diff']:.4g}   "
            f"KL mean {m['kl_mean']:.3g} max {m['kl_max']:.3g}")


def render_questions(report: dict) -> list[str]:
    """The two questions' answers, with the thresholds they were judged by."""
    from engine.export import verdict as v

    q1, q2 = report["question1"], report.get("question2") or {}
    lines = [f"1. Is the file right? {q1['status'].upper()}"]
    w = q1.get("weights")
    if w is None:
        lines.append("   weights: no separate unquantized file to compare with (not checked)")
    else:
        worst = w.get("worst") or {}
        lines.append(f"   weights: {w['checked']} tensors read back with gguf-py against "
                     f"{w['reference']}; {len(w['failed'])} beyond their type's rounding"
                     + (f" (largest relative error {worst['rel_error']:.3g} in {worst['name']} "
                        f"{worst['type']}, allowed {worst['bound']:.3g})" if worst else ""))
    cpp = q1.get("llamacpp") or {}
    if cpp.get("available"):
        bar = ("bit-exact (the doctor claims it for " + ", ".join(cpp["weight_types"]) + ")"
               if cpp["claimed_exact"] else f"same top-1 ≥ {v.Q1_MIN_TOP1:.1%} and mean KL ≤ "
               f"{v.Q1_MAX_KL:g} nats")
        lines.append(f"   llama.cpp vs the engine on the same file: same top-1 {cpp['top1']:.2%}, "
                     f"mean KL {cpp['kl_mean']:.3g}, max |Δlogit| {cpp['max_abs']:.3g}, greedy "
                     f"{cpp['greedy_matched']}/{cpp['greedy_total']}; needs {bar}")
        if cpp.get("note"):
            lines.append(f"   note: {cpp['note']}")
    else:
        lines.append(f"   llama.cpp: NOT ANSWERED ({q1.get('not_answered_because')})")
    for reason in q1.get("reasons", []):
        lines.append(f"   FAIL: {reason}")
    lines.append("2. What did quantization cost your fine-tune?")
    if not q2.get("available"):
        lines.append(f"   not measured: {q2.get('reason')}")
    else:
        kept = q2["gain_kept"]
        lines += [
            f"   on the run's {q2['split']}: {q2['samples']} samples, {q2['positions']} "
            "supervised tokens",
            f"   validation loss: base {q2['base_loss']:.4f}, fine-tune (merged, unquantized) "
            f"{q2['fine_tune_loss']:.4f}, this file {q2['export_loss']:.4f}",
            "   gain kept: " + (f"{kept:.1%}" if kept is not None else "n/a (no gain)")
            + f" (kept ≥ {v.KEPT_MIN:.0%}, lost < {v.LOST_BELOW:.0%})",
            f"   mean KL(fine-tune ‖ file) {q2['kl_mean']:.4g} nats, same top-1 "
            f"{q2['same_top1']:.2%}, Δ perplexity {q2['delta_ppl']:+.4g} (fine-tune "
            f"{q2['fine_tune_ppl']:.4g})"]
        for row in q2.get("answers", []):
            lines.append(f"   {row['prompt']!r}")
            for who in ("base", "fine_tune", "export"):
                lines.append(f"     {who.replace('_', '-'):<10} {row[who]!r}")
    picker = report.get("picker")
    if picker:
        lines.append("Quantization picker (size against the share of the gain kept):")
        for row in picker["rows"]:
            kept = row["gain_kept"]
            lines.append(f"   {row['dtype']:<8} {row['bytes'] / 1e6:9.2f} MB   keeps "
                         + (f"{kept:7.1%}" if kept is not None else "    n/a")
                         + f"   KL {row['kl_mean']:.3g}   same top-1 {row['same_top1']:.2%}")
        lines.append(f"   recommended: {picker['recommended'] or 'none keeps ≥ 90% of the gain'}"
                     f" (the smallest file keeping ≥ {v.KEPT_MIN:.0%})")
    return lines


def render_text(report: dict) -> str:
    """The report for people: one block per stage, then llama.cpp."""
    from engine.export.verdict import of_report

    verdict = of_report(report)
    lines = ["Export report", "=============", f"Verdict: {verdict.line}", ""]
    if "question1" in report:
        lines += render_questions(report) + [""]
    lines += ["Staged comparison with the training checkpoint",
              "----------------------------------------------",
              f"{len(report['prompt_suite'])} prompts; each stage scores every position of the "
              "prompt's last token and the checkpoint's greedy answer. These are diagnostics "
              "(where the answers move); the verdict above is the export's.",
              f"Stages within their bars: {'all' if report.get('passed') else 'not all'}"]
    if report.get("numerics"):                        # reports written before it existed lack it
        lines.append(report["numerics"])
    lines.append("")
    for stage in report["stages"]:
        lines.append(f"[{stage['name']}] {stage['description']}"
                     + (f" — {stage['file']}" if stage.get("file") else ""))
        if "vs_checkpoint" in stage:
            lines.append(_metrics_row("vs checkpoint", stage["vs_checkpoint"]))
            lines.append(_metrics_row("vs previous stage", stage["vs_previous"]))
            g = stage["greedy_vs_checkpoint"]
            lines.append(f"  greedy answers match the checkpoint: {sum(g['matches'])}/"
                         f"{len(g['matches'])}   tokenizer matches: {stage['tokenizer_matches']}")
            lines.append(_verdict_text(stage))
        else:
            lines.append(f"  {stage['positions']} scored positions")
        lines.append("")
    cpp = report["llamacpp"]
    if not cpp.get("available"):
        lines.append(f"[llama.cpp] not run: {cpp.get('reason')}")
    else:
        lines.append(f"[llama.cpp] {cpp['description']} — {cpp['file']}")
        if cpp.get("note"):
            lines.append(f"  note: {cpp['note']}")
        lines.append(_metrics_row("vs checkpoint", cpp["vs_checkpoint"]))
        if "vs_engine_same_file" in cpp:
            lines.append(_metrics_row("vs engine, same file", cpp["vs_engine_same_file"]))
            g = cpp["greedy_vs_engine_same_file"]
            lines.append(f"  greedy answers match the engine on the same file: "
                         f"{sum(g['matches'])}/{len(g['matches'])}")
        g = cpp["greedy_vs_checkpoint"]
        lines.append(f"  greedy answers match the checkpoint: {sum(g['matches'])}/"
                     f"{len(g['matches'])}   tokenizer matches: {cpp['tokenizer_matches']}")
        lines.append(_verdict_text(cpp))
        for row, answer in zip(report["prompt_suite"], cpp.get("answers", [])):
            if answer is not None:
                lines.append(f"    {row['prompt']!r} -> {answer!r}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
