"""Self-study (Eyuboglu et al., arXiv 2506.06266, §4): synthetic conversations about a corpus,
the teacher's top-k next-token log-probs over them, the distillation loss, and the held-out
comparison a cartridge run reports.

One conversation, as the paper's synthesizer makes it (one round):

1. a chunk of the corpus (a random span of `chunk_tokens` tokens);
2. a seed prompt from one of six families — structuring, summarisation, aggregation, question,
   use case, creative — asks model A (the base with the chunk in context) to write *one*
   message about the chunk (sampled, temperature `question_temperature`, as the paper's 0.6);
3. model B (the same base with the chunk in context) answers that message (greedy by default,
   as the paper's temperature 0), with the engine's generator (engine.llm.generate);
4. the teacher is B again: one forward over chunk + message + answer keeps, at every answer
   position, the top-k (k = 20 in the paper) next-token log-probs.

The chunk reaches the model as a plain prefix (`context_ids`: BOS + a short framing + the
text), the conversation after it in the base's chat template without its own BOS, so the
teacher reads [context | conversation] and the student reads [cartridge | conversation] with
the same conversation tokens at the same offsets after the prefix. The cartridge's rows start
as the prefill of `context_ids(whole corpus)`'s first p tokens.

Loss (the paper's "logits" loss): at each answer position, -Σ_top-k p_teacher(j) log
q_student(j), with p_teacher = exp of the stored log-probs (not renormalised), summed over the
answer tokens; the loop divides by the window's answer tokens.
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from dataclasses import dataclass

import torch

FAMILIES = ("structuring", "summarization", "aggregation", "question", "use_case", "creative")

CONTEXT_TEMPLATE = (
    "The conversation below is about the following corpus. Answer from it directly, without "
    "phrases such as \"according to the corpus\".\n\n<corpus>\n{text}\n</corpus>\n\n")

# The seed prompts: what model A is asked to write. Families and intent follow the paper's
# appendix; the wording is this project's.
_FORMATS = ("JSON", "YAML", "TOML", "a bulleted list", "a table in plain text", "XML")
SEED_PROMPTS: dict[str, tuple[str, ...]] = {
    "structuring": (
        "Write one chat message asking an assistant to put the information of a specific part "
        "of the corpus above into {format}, keeping exact names, numbers and commands. Reply "
        "with the message only.",
        "Write one request that asks for the facts of one section of the corpus above as "
        "{format}. Name the section clearly. Reply with the request only.",
    ),
    "summarization": (
        "Write one chat message asking an assistant to summarise a particular section of the "
        "corpus above; say clearly which section. Reply with the message only.",
        "Write one instruction asking for a short summary of part of the corpus above, naming "
        "the part by its title or topic. Reply with the instruction only.",
    ),
    "aggregation": (
        "Write one question whose answer needs facts from several different places in the "
        "corpus above (for example a comparison or a list collected across sections). Reply "
        "with the question only.",
        "Write one request asking an assistant to gather every mention of one topic across the "
        "corpus above into one answer. Reply with the request only.",
    ),
    "question": (
        "Write one question that tests knowledge of the corpus above. Include the names, "
        "numbers or titles that make clear what it asks about. Reply with the question only.",
        "Write one question about the corpus above that someone could answer from memory "
        "after reading it (closed book); be specific. Reply with the question only.",
        "You are quizzing a reader of the corpus above. Write one specific question about the "
        "part shown. Reply with the question only.",
    ),
    "use_case": (
        "Think of a practical task someone could do with the information in the corpus above, "
        "then write the one question or instruction they would ask an assistant while doing "
        "it. Reply with the question only.",
    ),
    "creative": (
        "Write one open, creative question inspired by the corpus above, to start a "
        "conversation about it. Reply with the question only.",
    ),
}


def seed_prompt(family: str, rng: random.Random) -> str:
    """One seed prompt of `family`, drawn with `rng` (a structuring prompt also draws its
    format)."""
    return rng.choice(SEED_PROMPTS[family]).format(format=rng.choice(_FORMATS))


# -- token layouts --------------------------------------------------------------------------
def context_ids(tokenizer, text: str) -> list[int]:
    """BOS (when the tokenizer wants one) + the framed text, no special tokens parsed: what the
    teacher reads before a conversation, and what the cartridge's rows start as."""
    from engine.cartridge.prefix import leading_bos

    body = tokenizer.encode(CONTEXT_TEMPLATE.format(text=text), add_special=False,
                            parse_special=False)
    return ([tokenizer.bos_id] if leading_bos(tokenizer) else []) + body


def prompt_ids(base, message: str) -> list[int]:
    """A user turn and the generation prompt, in the base's chat template (BOS included)."""
    from engine.llm.chat import encode_prompt

    return encode_prompt(base.tokenizer, base.template.render([{"role": "user",
                                                                 "content": message}]))


def after_context(tokenizer, ids: list[int]) -> list[int]:
    """A conversation's ids as they follow a context: without its own BOS (the context has it)."""
    from engine.cartridge.prefix import leading_bos

    return ids[1:] if leading_bos(tokenizer) and ids[:1] == [tokenizer.bos_id] else ids


def answer_logprobs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log softmax [len(answer), vocab] of the next token at each answer position, after
    `prompt` (one forward; the positions before the answer skip the last layer's MLP). A
    CartridgeModel reads its rows first."""
    ids = prompt + answer[:-1]
    rows = torch.zeros(1, len(ids), dtype=torch.bool)
    rows[0, len(prompt) - 1:] = True
    h = model.hidden(torch.tensor([ids]), 0, None, rows=rows)                 # [n, dim]
    logits = model.logits(h)                                                   # [n, V]
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)


# -- synthesis ------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One self-study sample: what the student reads, and the teacher's top-k at each answer
    token (ids [n, k] int64, log-probs [n, k] f32)."""

    family: str
    chunk: tuple[int, int]          # corpus token span the teacher saw
    question: str
    prompt_ids: list[int]           # the student's prompt (BOS + user turn + generation prompt)
    answer_ids: list[int]
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor

    def record(self) -> dict:
        return {"family": self.family, "chunk": list(self.chunk), "question": self.question,
                "prompt_ids": self.prompt_ids, "answer_ids": self.answer_ids}


def chunk_span(n_tokens: int, chunk_tokens: int, rng: random.Random) -> tuple[int, int]:
    """A random span of `chunk_tokens` corpus tokens (the whole corpus when it is shorter)."""
    if n_tokens <= chunk_tokens:
        return 0, n_tokens
    start = rng.randrange(0, n_tokens - chunk_tokens + 1)
    return start, start + chunk_tokens


@torch.no_grad()
def synthesize_one(base, sampler, corpus_ids: list[int], settings, index: int,
                   seed: int) -> Conversation:
    """Conversation `index` of a run seeded `seed` (its own RNGs: a resumed or extended run
    makes the same ones). `sampler` writes the message and the answer (the base as generate
    and chat serve it: llama.cpp numerics, the C forward); `base.model` (the f32 numerics the
    cartridge trains in) gives the teacher's log-probs."""
    from engine.llm.generate import generate
    from engine.sampling import SamplingSettings

    tok, model = base.tokenizer, base.model
    rng = random.Random(f"self-study:{seed}:{index}")
    family = settings.families[index % len(settings.families)]
    span = chunk_span(len(corpus_ids), settings.chunk_tokens, rng)
    context = context_ids(tok, tok.decode(corpus_ids[span[0]:span[1]]))
    seed_text = seed_prompt(family, rng)
    asked = generate(sampler, tok, context + after_context(tok, prompt_ids(base, seed_text)),
                     max_new_tokens=settings.question_tokens,
                     settings=SamplingSettings(temperature=settings.question_temperature),
                     seed=rng.randrange(2**31))
    question = asked.text.strip() or seed_text     # an empty message: the seed prompt itself
    student = prompt_ids(base, question)
    teacher = context + after_context(tok, student)
    answered = generate(sampler, tok, teacher, max_new_tokens=settings.answer_tokens,
                        settings=SamplingSettings(temperature=settings.answer_temperature),
                        seed=rng.randrange(2**31))
    answer = answered.ids or [tok.eos_id]
    top = answer_logprobs(model, teacher, answer).topk(settings.top_k, dim=-1)
    return Conversation(family, span, question, student, answer, top.indices,
                        top.values.float())


def save_conversations(path, conversations: list[Conversation], meta: dict) -> None:
    """The samples as one safetensors file: top-k tensors per sample, the rest as JSON."""
    import json

    from safetensors.torch import save_file

    tensors = {}
    for i, c in enumerate(conversations):
        tensors[f"ids.{i}"] = c.topk_ids.contiguous()
        tensors[f"logprobs.{i}"] = c.topk_logprobs.contiguous()
    save_file(tensors, str(path), metadata={
        "meta": json.dumps(meta, sort_keys=True),
        "records": json.dumps([c.record() for c in conversations])})


def load_conversations(path) -> tuple[list[Conversation], dict]:
    import json

    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        header = handle.metadata()
        records = json.loads(header["records"])
        out = [Conversation(r["family"], tuple(r["chunk"]), r["question"], r["prompt_ids"],
                            r["answer_ids"], handle.get_tensor(f"ids.{i}"),
                            handle.get_tensor(f"logprobs.{i}"))
               for i, r in enumerate(records)]
    return out, json.loads(header["meta"])


# -- the loss -------------------------------------------------------------------------------
def distillation_loss(student, sample: Conversation) -> tuple[torch.Tensor, int]:
    """(Σ over answer tokens of -Σ_top-k p_teacher log q_student, answer tokens): the student
    is the base reading the cartridge (a CartridgeModel), then the conversation."""
    logp = answer_logprobs(student, sample.prompt_ids, sample.answer_ids)      # [n, V]
    mine = logp.gather(-1, sample.topk_ids)                                    # [n, k]
    teacher = sample.topk_logprobs.to(mine.dtype).exp()
    return -(teacher * mine).sum(), len(sample.answer_ids)


# -- the held-out comparison ----------------------------------------------------------------
SYSTEMS = ("no document", "whole document", "cartridge")


@torch.no_grad()
def time_to_first_token(model, ids: list[int]) -> float:
    """Seconds from an empty cache (a cartridge's seeded) to the first token's logits."""
    started = time.perf_counter()
    cache = model.new_cache(1, len(ids) + 1)
    h = model.hidden(torch.tensor([ids]), 0, cache)
    model.logits(h[:, -1])
    return time.perf_counter() - started


def answer_f1(answer: str, reference: str) -> float:
    """Answer quality: the token F1 of a generated answer against the reference (SQuAD's
    measure: lower-cased words, punctuation dropped, overlap counted with multiplicity); 0 when
    either has no word."""
    said, wanted = (Counter(re.findall(r"[a-z0-9]+", t.lower())) for t in (answer, reference))
    overlap = sum((said & wanted).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / sum(said.values()), overlap / sum(wanted.values())
    return 2 * precision * recall / (precision + recall)


@torch.no_grad()
def compare(base, scoring: dict, serving: dict, corpus_text: str, questions: list[dict],
            max_tokens: int, cartridge_tokens: int, progress=None) -> dict:
    """Each held-out {question, answer, source} read three ways (`SYSTEMS`): the base without
    the document, with the whole corpus in context, reading the cartridge. `scoring[system]`
    (f32 numerics) gives the reference answer's log-likelihood (per token and summed);
    `serving[system]` (as generate and chat serve it) a greedy answer, its token F1 against the
    reference (`answer_f1`) and the time to first token. Also the KV positions the document
    part takes and their f16 bytes."""
    from engine.cartridge.prefix import kv_bytes_per_token
    from engine.llm.generate import generate

    tok = base.tokenizer
    document = context_ids(tok, corpus_text)
    per_token = kv_bytes_per_token(base.model)
    prefix_tokens = {"no document": 0, "whole document": len(document),
                     "cartridge": cartridge_tokens}
    rows = []
    totals = {s: {"logprob": 0.0, "tokens": 0, "ttft": 0.0, "f1": 0.0} for s in SYSTEMS}
    for number, item in enumerate(questions):
        prompt = prompt_ids(base, item["question"])
        reference = tok.encode(item["answer"], add_special=False, parse_special=False)
        row = {"question": item["question"], "reference": item["answer"],
               "source": item.get("source", "hand-written")}
        for system in SYSTEMS:
            ids = document + after_context(tok, prompt) if system == "whole document" else prompt
            logp = answer_logprobs(scoring[system], ids, reference)
            total = float(logp.gather(-1, torch.tensor(reference)[:, None]).sum())
            ttft = time_to_first_token(serving[system], ids)
            text = generate(serving[system], tok, ids, max_new_tokens=max_tokens).text
            f1 = answer_f1(text, item["answer"])
            row[system] = {"logprob": total, "logprob_per_token": total / len(reference),
                           "answer": text, "answer_f1": f1, "ttft_s": ttft}
            totals[system]["logprob"] += total
            totals[system]["tokens"] += len(reference)
            totals[system]["ttft"] += ttft
            totals[system]["f1"] += f1
        rows.append(row)
        if progress is not None:
            progress(number + 1, len(questions))
    summary = {system: {
        "logprob_per_token": totals[system]["logprob"] / max(totals[system]["tokens"], 1),
        "logprob_sum": totals[system]["logprob"],
        "answer_f1": totals[system]["f1"] / max(len(questions), 1),
        "kv_prefix_tokens": prefix_tokens[system],
        "kv_prefix_bytes_f16": prefix_tokens[system] * per_token,
        "mean_ttft_s": totals[system]["ttft"] / max(len(questions), 1)} for system in SYSTEMS}
    return {"systems": summary, "questions": rows, "reference_tokens":
            totals["cartridge"]["tokens"], "kv_bytes_per_token_f16": per_token}


def report_markdown(result: dict, checkpoint: str) -> str:
    """The comparison as a table a person reads (evals/cartridge-<checkpoint>.md)."""
    lines = [f"# Cartridge held-out comparison ({checkpoint})", "",
             f"{len(result['questions'])} held-out questions, "
             f"{result['reference_tokens']} reference-answer tokens.", "",
             "| system | log-likelihood / token | answer F1 | KV prefix (tokens) "
             "| KV prefix (f16 bytes) | mean TTFT (s) |", "|---|---|---|---|---|---|"]
    for system, s in result["systems"].items():
        lines.append(f"| {system} | {s['logprob_per_token']:.4f} | {s['answer_f1']:.3f} | "
                     f"{s['kv_prefix_tokens']} | {s['kv_prefix_bytes_f16']:,} | "
                     f"{s['mean_ttft_s']:.3f} |")
    lines += ["", "## Answers", ""]
    for row in result["questions"]:
        lines += [f"**Q** ({row['source']}): {row['question']}", "",
                  f"- reference: {row['reference']}"]
        lines += [f"- {system} (F1 {row[system]['answer_f1']:.2f}): "
                  f"{row[system]['answer'].strip()}" for system in SYSTEMS]
        lines.append("")
    return "\n".join(lines)
