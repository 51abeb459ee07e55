"""The staged equivalence report: does the exported model answer as the trained one does?

On a fixed prompt suite, each stage is loaded back from disk in a fresh process and scored on
the same token sequences (each prompt followed by the training checkpoint's greedy answer):

1. `checkpoint` — the training checkpoint as the recipe loads it (base + adapter for LoRA runs);
2. `merged`     — the dense GGUF (adapters folded in, or the lm-pretrain model as written);
3. `quantized`  — the quantized GGUF, when the export is quantized;
4. `llama.cpp`  — the exported file (or base + GGUF LoRA) in llama.cpp, when llama-cpp-python
   is installed.

Per stage: top-1 agreement, max and mean |Δlogit| and KL(reference ‖ stage) against the
checkpoint and against the previous stage, whether its own greedy continuation matches the
checkpoint's, and whether its tokenizer gives the same prompt ids. Engine stages run with f32
arithmetic, so their differences are the weights' (merge rounding, quantization); the llama.cpp
stage adds the runtime's own arithmetic and is also compared with the engine on the same file.

A stage worker is `python -m engine.export.equivalence SPEC.json`: it writes logits and greedy ids
to a safetensors file, which the parent compares one prompt at a time. The checkpoint and llama.cpp
decode token by token (llama.cpp as it serves an answer); the other engine stages score each
prompt and answer in one batch and read their greedy answer off those logits (`greedy_along`),
decoding on only where it leaves the answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.errors import ForgebenchError
from engine.kernels.cpu import plan

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
        checked = [s["passed"] for s in self.stages if "passed" in s]
        if self.llamacpp.get("available"):
            checked.append(self.llamacpp["passed"])
        return {"prompt_suite": self.prompts, "stages": self.stages, "llamacpp": self.llamacpp,
                "passed": bool(checked) and all(checked), "numerics": plan().summary()}


# ----------------------------------------------------------------------- the worker (child)

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

    net, tok = load_gguf_model(model["path"], numerics=model.get("numerics", "f32"),
                               weights="dense-cache")      # dequantized once: many forwards
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


def _engine_worker(spec: dict) -> dict:
    import torch

    from engine.llm.chat import encode_prompt
    from engine.sampling import SamplingSettings, generate_tokens

    torch.set_num_threads(spec.get("threads", 1))
    net, tok, render = _load_engine(spec["model"])
    stops, limit = _stop_ids(tok), spec["greedy_tokens"]

    def decode(prompt: list[int], n: int) -> list[int]:
        cache = net.new_cache(1, len(prompt) + n)

        def step(new_ids: list[int], start_pos: int) -> torch.Tensor:
            h = net.hidden(torch.tensor([new_ids]), start_pos=start_pos, cache=cache)
            return net.logits(h[0, -1]).float()

        return generate_tokens(step, list(prompt), max_new_tokens=n,
                               settings=SamplingSettings(), stop_ids=stops)

    def score(seq: list[int], start: int) -> torch.Tensor:
        return net.logits(net.hidden(torch.tensor([seq]))[0, start:]).float()

    out: dict = {"texts": [], "prompt_ids": [], "greedy": [], "logits": []}
    with torch.no_grad():
        texts = spec["texts"] if "texts" in spec else [render(p) for p in spec["prompts"]]
        for i, text in enumerate(texts):
            ids = encode_prompt(tok, text)
            out["texts"].append(text)
            out["prompt_ids"].append(ids)
            if "sequences" in spec:
                # every other stage scores the reference's answer and reads its greedy off it
                seq, start = spec["sequences"][i], spec["scored_from"][i]
                prompt = seq[:start + 1]
                logits = score(seq, start)
                greedy, finished = greedy_along(logits, seq[start + 1:], limit, stops)
                if not finished and len(greedy) < limit:
                    greedy += decode(prompt + greedy, limit - len(greedy))
            else:                           # the reference decodes and scores its own answers
                greedy = decode(ids, limit)
                logits = score(ids + greedy, len(ids) - 1)
            out["greedy"].append(greedy)
            out["logits"].append(logits)
    return out


def _llamacpp_worker(spec: dict) -> dict:
    import llama_cpp
    import numpy as np
    import torch

    from engine.llm.tokenizer import GGUFTokenizer

    model = spec["model"]
    meta_tok = GGUFTokenizer.from_gguf(model["path"])     # flags and stop ids of the same file
    limit = spec["greedy_tokens"]
    longest = max(len(s) for s in spec["sequences"]) + limit + 8
    llm = llama_cpp.Llama(model["path"], lora_path=model.get("lora"), n_ctx=max(64, longest),
                          n_batch=512, logits_all=True, n_threads=spec.get("threads", 1),
                          verbose=False, seed=0)
    stops = _stop_ids(meta_tok)
    out: dict = {"texts": spec["texts"], "prompt_ids": [], "greedy": [], "logits": []}
    for i, text in enumerate(spec["texts"]):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if meta_tok.add_bos and meta_tok.bos_id is not None and ids[:1] != [meta_tok.bos_id]:
            ids.insert(0, meta_tok.bos_id)
        out["prompt_ids"].append(ids)
        seq, start = spec["sequences"][i], spec["scored_from"][i]
        # the greedy answer as llama.cpp serves it: the prompt in one batch, then token by token
        # (its one-row kernels sum differently from its batch kernels, so reading the answer off
        # batched logits could flip a near-tie that a served answer would not)
        llm.reset()
        llm.eval(seq[:start + 1])
        greedy: list[int] = []
        while len(greedy) < limit:
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if token in stops:
                break
            greedy.append(token)
            llm.eval([token])
        llm.reset()
        llm.eval(seq)                                   # one batch: prompt and reference answer
        logits = torch.from_numpy(np.array(llm.scores[start:len(seq)], dtype=np.float32))
        out["greedy"].append(greedy)
        out["logits"].append(logits)
    return out


def _write_result(out: dict, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {f"logits.{i}": t.contiguous() for i, t in enumerate(out["logits"])}
    meta = {k: json.dumps(out[k]) for k in ("texts", "prompt_ids", "greedy")}
    save_file(tensors or {"empty": torch.zeros(1)}, str(path), metadata=meta)


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text("utf-8"))
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

    def logits(self, i: int):
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(f"logits.{i}").double()


def _run_stage(spec: dict, workdir: Path, name: str, threads: int) -> StageResult:
    """Run one stage in a fresh Python process and read back what it wrote."""
    out = workdir / f"{name}.safetensors"
    spec = dict(spec, out=str(out), threads=threads)
    spec_path = workdir / f"{name}.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        OMP_NUM_THREADS=str(threads))
    result = subprocess.run([sys.executable, "-m", "engine.export.equivalence", str(spec_path)],
                            env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise ForgebenchError(f"equivalence stage '{name}' failed:\n"
                              + (result.stderr.strip().splitlines() or ["(no output)"])[-1],
                              where=f"stage {name}", hint="see the message above; rerun "
                              "with --no-report to export without the report")
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as handle:
        meta = handle.metadata()
    return StageResult(out, *(json.loads(meta[k]) for k in ("texts", "prompt_ids", "greedy")))


def compare(reference: StageResult, other: StageResult, n: int) -> dict:
    """Top-1 agreement, |Δlogit| and KL(reference ‖ other) over every scored position."""

    agree = positions = 0
    max_abs, sum_abs, count, kl_sum, kl_max = 0.0, 0.0, 0, 0.0, 0.0
    for i in range(n):
        a, b = reference.logits(i), other.logits(i)               # [P, V] f64
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += a.shape[0]
        diff = (a - b).abs()
        max_abs = max(max_abs, float(diff.max()))
        sum_abs += float(diff.sum())
        count += diff.numel()
        log_p, log_q = a.log_softmax(-1), b.log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)              # [P]
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        del a, b, diff, log_p, log_q
    return {"positions": positions, "top1_agreement": agree / positions,
            "max_abs_logit_diff": max_abs, "mean_abs_logit_diff": sum_abs / count,
            "kl_mean": kl_sum / positions, "kl_max": kl_max}


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
                 prompts: tuple[str, ...] = PROMPT_SUITE, greedy_tokens: int = GREEDY_TOKENS,
                 threads: int = 1, decode: Callable[[list[int]], str] | None = None,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Score the checkpoint (`reference`, a worker load spec) and each stage; return the report."""
    say = progress or (lambda _msg: None)
    with tempfile.TemporaryDirectory(prefix="forgebench-equivalence-") as tmp:
        workdir = Path(tmp)
        say("checkpoint: greedy answers and scoring")
        ref = first = _run_stage({"model": reference, "prompts": list(prompts),
                                  "greedy_tokens": greedy_tokens}, workdir, "checkpoint", threads)
        sequences = [p + g for p, g in zip(first.prompt_ids, first.greedy)]
        scored_from = [len(p) - 1 for p in first.prompt_ids]
        common = {"texts": first.texts, "sequences": sequences, "scored_from": scored_from,
                  "greedy_tokens": greedy_tokens}
        n = len(sequences)
        prompt_rows = [{"prompt": p, "prompt_tokens": len(ids), "answer_tokens": len(g),
                        "answer": decode(g) if decode else None}
                       for p, ids, g in zip(prompts, first.prompt_ids, first.greedy)]
        report = Report(prompt_rows)
        report.stages.append({"name": "checkpoint", "description": "training checkpoint "
                              "(reference)", "file": None, "positions":
                              sum(len(s) - f for s, f in zip(sequences, scored_from))})
        previous, results = ref, {}
        for stage in stages:
            say(f"{stage.name}: scoring")
            got = _run_stage(dict(common, model=stage.model), workdir, stage.name, threads)
            results[stage.name] = got
            vs_checkpoint = compare(ref, got, n)
            entry = {
                "name": stage.name, "description": stage.description, "file": stage.file,
                "tokenizer_matches": got.prompt_ids == first.prompt_ids,
                "vs_checkpoint": vs_checkpoint,
                "vs_previous": vs_checkpoint if previous is ref else compare(previous, got, n),
                "greedy_vs_checkpoint": _greedy_match(ref, got)}
            report.stages.append({**entry, **verdict(entry, stage.min_top1)})
            previous = got
        if llamacpp is None:
            report.llamacpp = {"available": False, "reason": "no llama.cpp stage for this export"}
        elif (missing := llamacpp_available()) is not None:
            report.llamacpp = {"available": False, "reason": missing}
        else:
            say("llama.cpp: scoring")
            got = _run_stage(dict(common, model=llamacpp.model), workdir, "llamacpp", threads)
            engine_same_file = results.get(stages[-1].name) if stages else None
            report.llamacpp = {
                "available": True, "description": llamacpp.description, "file": llamacpp.file,
                "tokenizer_matches": got.prompt_ids == first.prompt_ids,
                "vs_checkpoint": compare(ref, got, n),
                "greedy_vs_checkpoint": _greedy_match(ref, got),
                "answers": [decode(g) if decode else None for g in got.greedy]}
            report.llamacpp.update(verdict(report.llamacpp, llamacpp.min_top1))
            if engine_same_file is not None:
                report.llamacpp["vs_engine_same_file"] = compare(engine_same_file, got, n)
                report.llamacpp["greedy_vs_engine_same_file"] = _greedy_match(engine_same_file,
                                                                              got)
    return report.as_dict()


def _verdict_text(entry: dict) -> str:
    return (f"  verdict: {'pass' if entry['passed'] else 'FAIL'} (needs top-1 ≥ "
            f"{entry['min_top1'] * 100:.0f}% and the same tokenizer)")


def _metrics_row(name: str, m: dict) -> str:
    return (f"  {name:<28} top-1 {m['top1_agreement'] * 100:6.2f}%   max|Δ| "
            f"{m['max_abs_logit_diff']:.4g}   mean|Δ| {m['mean_abs_logit_diff']:.4g}   "
            f"KL mean {m['kl_mean']:.3g} max {m['kl_max']:.3g}")


def render_text(report: dict) -> str:
    """The report for people: one block per stage, then llama.cpp."""
    lines = ["Equivalence report", "==================",
             f"{len(report['prompt_suite'])} prompts; each stage scores every position of the "
             "prompt's last token and the checkpoint's greedy answer.",
             f"Overall: {'VERIFIED' if report.get('passed') else 'NOT verified'}"]
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
