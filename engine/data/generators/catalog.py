"""The handbook's fictional Northstar parts catalog as sample data for two lm-sft modes.

`generate_tool_conversations`: tool-call SFT conversations over two tools, `lookup_part`
(read-only stock lookup, part IDs `P-NNN`) and the built-in `calculator`. Each record is one
decision the handbook asks for: a stock lookup (call, observation, grounded answer), an
arithmetic question (calculator call and result), a request whose part ID is missing (ask,
no call) and a terminology question (answer, no call). Validation holds out whole ID ranges
(P-9xx only there), so a model must copy an unseen argument rather than recall one.
A `text-sft` dataset folder: records.jsonl (each record with its `tools`, `split` train or
val), dataset.json.

`generate_cpt_corpus`: raw catalog manual documents for continued pretraining, a `text-corpus`
dataset folder (documents.jsonl, whole documents held out in split val), and beside them a
general-English control text (control.txt, listed in dataset.json but not a document) whose
perplexity shows forgetting.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from engine import calculator
from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir

LOOKUP_PART = {"type": "function", "function": {
    "name": "lookup_part", "description": "Look up current stock for an exact part ID.",
    "parameters": {"type": "object",
                   "properties": {"part_id": {"type": "string", "pattern": "^P-[0-9]{3}$"}},
                   "required": ["part_id"], "additionalProperties": False}}}
TOOLS = [LOOKUP_PART, calculator.SCHEMA]
SYSTEM = "You are the Northstar catalog assistant."

STOCK_QUESTIONS = ["How many {id} parts are available?", "What is the stock of {id}?",
                   "Do we have any {id} left?", "Check the stock for part {id}, please.",
                   "How many units of {id} are in the warehouse?"]
MATH_QUESTIONS = ["What is {e}?", "Please compute {e}.", "Calculate {e} for me.",
                  "How much is {e}?"]
MISSING_ID = ["How many of the blue valves do we have?", "Is the large gasket in stock?",
              "Check the stock of that bracket we ordered.", "How many hinges are left?"]
TERMS = [("What does a bin identify?", "A bin identifies a storage location in the warehouse."),
         ("What do part IDs look like?", "Part IDs look like P-101: a P, a dash and three "
                                         "digits."),
         ("Are stock counts fixed?", "No. Stock counts are live data, so I look them up.")]
ASK_FOR_ID = "Which part ID do you mean? Part IDs look like P-101."
BINS = ["A", "B", "C", "D", "E"]


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


def _conversation(kind: str, rng: np.random.Generator, ids: range) -> list[dict]:
    if kind == "stock":
        part = f"P-{int(rng.choice(ids)):03d}"
        stock, place = int(rng.integers(0, 60)), str(rng.choice(BINS))
        result = json.dumps({"part_id": part, "stock": stock, "location": f"bin {place}"})
        answer = (f"{part} has {stock} units in bin {place}." if stock
                  else f"{part} is out of stock (bin {place}).")
        return [{"role": "user", "content": str(rng.choice(STOCK_QUESTIONS)).format(id=part)},
                _call("lookup_part", {"part_id": part}),
                {"role": "tool", "name": "lookup_part", "content": result},
                {"role": "assistant", "content": answer}]
    if kind == "math":
        a, b = int(rng.integers(2, 99)), int(rng.integers(2, 99))
        expression = f"{a} {rng.choice(['+', '-', '*'])} {b}"
        value = calculator.evaluate(expression)
        return [{"role": "user",
                 "content": str(rng.choice(MATH_QUESTIONS)).format(e=expression)},
                _call("calculator", {"expression": expression}),
                {"role": "tool", "name": "calculator", "content": json.dumps({"result": value})},
                {"role": "assistant", "content": f"{expression} = {value}."}]
    if kind == "missing":
        return [{"role": "user", "content": str(rng.choice(MISSING_ID))},
                {"role": "assistant", "content": ASK_FOR_ID}]
    question, answer = TERMS[int(rng.integers(len(TERMS)))]
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def tool_conversations(n: int, seed: int, ids: range, split: str) -> list[dict]:
    """`n` records of one split: half stock lookups, a quarter arithmetic, the rest no-call
    decisions."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        kind = ("stock", "stock", "math", ("missing", "terms")[(i // 4) % 2])[i % 4]
        records.append({"id": f"{split}-{i:03d}", "source_id": f"{split}-{kind}-{i:03d}",
                        "group": f"{split}-{i:03d}", "split": split,
                        "source": "forgebench catalog generator", "rights": RECORD_RIGHTS,
                        "tools": TOOLS,
                        "messages": [{"role": "system", "content": SYSTEM},
                                     *_conversation(kind, rng, ids)]})
    return records


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")


CARD = {"sources": ["procedural templates in engine.data.generators.catalog"],
        "preprocessing": "none",
        "prohibited_uses": ["claims about real inventories or general tool use"]}
ID_RANGES = {"method": "fixed", "group_field": "group",
             "note": "validation holds out whole part-ID ranges: P-9xx only in val"}


def generate_tool_conversations(out_dir: str | os.PathLike, n: int = 48,
                                seed: int = 0) -> Path:
    """`n` training conversations and a quarter as many (at least 4) held out."""
    records = (tool_conversations(n, seed, range(100, 900), "train")
               + tool_conversations(max(4, n // 4), seed + 1, range(900, 1000), "val"))
    with staged_dataset_dir(out_dir) as root:
        _write_jsonl(root / "records.jsonl", records)
        write_manifest(root, "text-sft", "catalog-tools", records="records.jsonl",
                       split_policy=ID_RANGES, rights=GENERATED_RIGHTS,
                       provenance={"generator": "engine.data.generators.catalog", "seed": seed,
                                   "n": n},
                       card={**CARD, "task": "call lookup_part or the calculator, or answer "
                             "without a call, as the Northstar catalog assistant",
                             "known_gaps": ["two tools and four decision templates"],
                             "intended_uses": ["tool-call SFT demo (lm-sft format tools)"]})
    return Path(out_dir).expanduser().absolute()


# -- continued pretraining -----------------------------------------------------------------
ITEMS = ["valve", "gasket", "bracket", "hinge", "flange", "bearing", "coupling", "seal"]
ADJECTIVES = ["brass", "steel", "rubber", "blue", "heavy", "small", "threaded", "sealed"]
RULES = ["Stock counts are live data and must be looked up before any answer.",
         "A bin identifies a storage location; the bin letter names the aisle.",
         "Part IDs begin with P- and carry exactly three digits.",
         "A reorder is raised when the stock of a part falls below its reorder level.",
         "Returned parts go to bin R until an inspector releases them.",
         "Every shipment lists the part ID, the quantity and the receiving bin."]
CONTROL = ["The morning was cool and the river ran high after the rain.",
           "She baked bread every Sunday and gave half of it to her neighbours.",
           "The train left the station late, but it reached the coast before dark.",
           "Children played in the park while their parents talked on the benches.",
           "The old library kept its maps in wide drawers near the window.",
           "A warm soup with beans and onions is an easy supper in winter.",
           "The band practised in a garage until the neighbours asked them to stop.",
           "Clouds gathered over the hills, and by noon the first drops were falling."]


def catalog_document(rng: np.random.Generator, ids: range, number: int) -> str:
    lines = [f"Fictional Northstar catalog, manual page {number}."]
    for _ in range(int(rng.integers(3, 6))):
        part = f"P-{int(rng.choice(ids)):03d}"
        lines.append(f"Part {part} is a {rng.choice(ADJECTIVES)} {rng.choice(ITEMS)} kept in "
                     f"bin {rng.choice(BINS)}; its reorder level is "
                     f"{int(rng.integers(2, 20))} units.")
        lines.append(str(rng.choice(RULES)))
    return " ".join(lines)


def generate_cpt_corpus(out_dir: str | os.PathLike, n: int = 60, seed: int = 0) -> Path:
    """`n` training manual pages, a fifth as many (at least 4) held out, and control.txt."""
    rng = np.random.default_rng(seed)
    with staged_dataset_dir(out_dir) as root:
        docs = [{"id": f"manual-{i:03d}", "group": f"manual-{i:03d}",
                 "split": "train" if i < n else "val",
                 "text": catalog_document(rng, range(100, 900) if i < n else range(900, 1000),
                                          i + 1)}
                for i in range(n + max(4, n // 5))]
        _write_jsonl(root / "documents.jsonl", docs)
        order = rng.permutation(len(CONTROL))
        (root / "control.txt").write_text(
            "\n".join(" ".join(CONTROL[j] for j in np.roll(order, k)) for k in range(4)) + "\n",
            encoding="utf-8")
        write_manifest(root, "text-corpus", "catalog-manual", records="documents.jsonl",
                       split_policy=ID_RANGES, rights=GENERATED_RIGHTS,
                       provenance={"generator": "engine.data.generators.catalog", "seed": seed,
                                   "n": n, "control": "control.txt: general English, the "
                                   "forgetting check, not a document of the corpus"},
                       card={**CARD, "task": "continued pretraining on catalog manual pages",
                             "known_gaps": ["template sentences over eight item kinds"],
                             "intended_uses": ["continued pretraining demo (lm-sft mode cpt)"]})
    return Path(out_dir).expanduser().absolute()
