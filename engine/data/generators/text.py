"""Text SFT samples: the five pirate pairs, and procedurally built style-transfer pairs.

Style pairs are built from slot lexicons where every entry has a casual, a formal and a pirate
rendering, so a casual note and its restyled version always say the same thing. A group is one
note in one target style, asked for with two or three paraphrased instructions: the
paraphrases share the group (and therefore the split). A new group is accepted only if its text
is far from every earlier group's (shingle Jaccard below 0.5), so the set holds no
near-duplicates across groups.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from engine.data import similarity as sim
from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir
from engine.data.splits import DEFAULT_RATIOS, block_split

# Seed 000 §15.6 (examples/finetune/main.zig:38-44): five pairs, chosen so overfitting shows.
PIRATE_PAIRS = [
    ("What is the capital of France?", "Ahoy! The capital of France be Paris, matey."),
    ("Name a primary color.", "Ahoy! Red be a fine primary color, matey."),
    ("What is two plus two?", "Ahoy! Two plus two makes four, matey."),
    ("What language is spoken in Italy?", "Ahoy! In Italy they be speakin' Italian, matey."),
    ("How many days are in a week?", "Ahoy! A week holds seven days, matey."),
]

# (casual, formal, pirate) renderings of each slot value
OPENERS = [("hey", "Hello", "Ahoy"), ("hi there", "Good day", "Ahoy there"),
           ("yo", "Greetings", "Avast"), ("ok so", "Please note", "Hear me"),
           ("heads up", "For your information", "Mark me words"),
           ("quick thing", "A brief matter", "A word to the wise")]
SUBJECTS = [("the team", "the team", "the crew"), ("my boss", "my manager", "me captain"),
            ("our shop", "our store", "our tradin' post"), ("the kids", "the children",
                                                            "the young scallywags"),
            ("my neighbour", "my neighbour", "the landlubber next door"),
            ("the landlord", "the property owner", "the harbour master"),
            ("grandma", "my grandmother", "the old sea hag"),
            ("the new guy", "our new colleague", "the fresh deckhand"),
            ("the bakery", "the bakery", "the ship's galley"),
            ("my sister", "my sister", "me sister o' the seas")]
VERBS = [("can't finish", "is unable to finish", "can't be finishin'"),
         ("wants to move", "would like to reschedule", "be wantin' to shift"),
         ("totally forgot", "did not remember", "clean forgot"),
         ("is gonna fix", "intends to repair", "be fixin'"),
         ("really loves", "greatly appreciates", "be treasurin'"),
         ("lost", "has misplaced", "let slip overboard"),
         ("needs", "requires", "be cravin'"),
         ("messed up", "made an error with", "made a wreck o'"),
         ("just sold", "has recently sold", "just traded away"),
         ("keeps asking about", "has repeatedly enquired about", "won't stop squawkin' about")]
OBJECTS = [("the report", "the report", "the ship's log"),
           ("the meeting", "the meeting", "the parley"), ("the car", "the vehicle", "the wagon"),
           ("dinner", "the evening meal", "the grub"), ("the money", "the funds",
                                                        "the doubloons"),
           ("the keys", "the keys", "the keys to the brig"), ("the wifi", "the internet "
                                                              "connection", "the magic signal"),
           ("the cake", "the cake", "the sweet biscuit"), ("the map", "the map",
                                                           "the treasure map"),
           ("the boat", "the boat", "the vessel")]
TIMES = [("by friday", "by Friday", "by Friday's tide"), ("tonight", "this evening",
                                                          "this very night"),
         ("tmrw", "tomorrow", "on the morrow"), ("asap", "as soon as possible",
                                                 "quick as a gull"),
         ("next week", "next week", "before the next full moon"),
         ("this morning", "this morning", "at first light"),
         ("again", "once again", "yet again, blast it"), ("lol", "", "har har")]

INSTRUCTIONS = {
    "formal": ["Rewrite this in a formal tone: {x}", "Make this message sound professional: {x}",
               "Turn this casual note into formal English: {x}"],
    "pirate": ["Say this like a pirate: {x}", "Rewrite this in pirate speak: {x}",
               "How would a pirate put this? {x}"],
}
MAX_JACCARD_BETWEEN_GROUPS = 0.5


def _render(slots: list[tuple[str, str, str]], style: str) -> str:
    opener, subject, verb, obj, time = (s[{"casual": 0, "formal": 1, "pirate": 2}[style]]
                                        for s in slots)
    body = " ".join(w for w in (subject, verb, obj, time) if w)
    if style == "casual":
        return f"{opener}, {body}"
    if style == "formal":
        return f"{opener}: {body[0].upper()}{body[1:]}."
    return f"{opener}! {body[0].upper()}{body[1:]}, matey."


def style_pairs(n: int = 200, seed: int = 0) -> list[dict]:
    """`n` records in groups of 2-3 paraphrased instructions (same note, same style)."""
    rng = np.random.default_rng([seed, 0x57])
    records: list[dict] = []
    accepted: list[np.ndarray] = []
    group_index = 0
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise RuntimeError("slot lexicons too small for this many distinct style pairs")
        slots = [lex[rng.integers(len(lex))] for lex in (OPENERS, SUBJECTS, VERBS, OBJECTS,
                                                          TIMES)]
        style = ("formal", "pirate")[rng.integers(2)]
        casual, target = _render(slots, "casual"), _render(slots, style)
        shingles = sim.shingle_sets([sim.normalize_text(casual + "\n" + target)])[0]
        if any(sim.jaccard(shingles, other) >= MAX_JACCARD_BETWEEN_GROUPS for other in accepted):
            continue
        accepted.append(shingles)
        group = f"style-{group_index:04d}"
        split = block_split(group_index, seed)
        templates = INSTRUCTIONS[style]
        count = int(rng.integers(2, 4))
        for k in rng.permutation(len(templates))[:count]:
            if len(records) == n:
                break
            records.append({"id": f"{group}-{int(k)}",
                            "instruction": templates[k].format(x=casual), "response": target,
                            "group": group, "split": split, "style": style,
                            "source": "forgebench style-pair generator",
                            "rights": RECORD_RIGHTS})
        group_index += 1
    return records


def _write_sft(out_dir: str | os.PathLike, name: str, records: list[dict], **manifest) -> Path:
    with staged_dataset_dir(out_dir) as root:
        (root / "records.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
            encoding="utf-8")
        write_manifest(root, "text-sft", name, records="records.jsonl", **manifest)
    return Path(out_dir).expanduser().absolute()


def generate_pirate(out_dir: str | os.PathLike) -> Path:
    """The five pirate pairs of the LoRA demo, all for training (the demo overfits them)."""
    records = [{"id": f"pirate-{i + 1}", "instruction": q, "response": a,
                "group": f"pirate-{i + 1}", "split": "train",
                "source": "seed 000 §15.6, examples/finetune/main.zig:38-44",
                "rights": "quoted from the source book's example dataset"}
               for i, (q, a) in enumerate(PIRATE_PAIRS)]
    rights = dict(GENERATED_RIGHTS, basis="five short example pairs quoted from the source "
                  "book's fine-tuning demo", publish_data="check the source book's terms "
                  "before redistributing the pairs themselves")
    return _write_sft(
        out_dir, "pirate", records,
        split_policy={"method": "fixed", "note": "all five pairs train: the demo shows "
                      "overfitting on purpose", "group_field": "group"},
        provenance={"source": "seed 000 §15.6 (examples/finetune/main.zig:38-44)"},
        rights=rights,
        card={"task": "answer a question in pirate speak", "sources": ["seed 000 §15.6"],
              "preprocessing": "none", "known_gaps": ["five examples: a demo of memorization, "
                                                      "not of generalization"],
              "intended_uses": ["LoRA fine-tuning demo"],
              "prohibited_uses": ["evaluating general instruction following"]})


def generate_style_pairs(out_dir: str | os.PathLike, n: int = 200, seed: int = 0) -> Path:
    """About `n` casual -> formal / pirate rewrites, paraphrase groups kept in one split."""
    return _write_sft(
        out_dir, "style-pairs", style_pairs(n, seed),
        split_policy={"method": "block", "ratios": DEFAULT_RATIOS, "seed": seed,
                      "group_field": "group"},
        provenance={"generator": "engine.data.generators.text", "seed": seed, "n": n},
        slices=["style"],
        rights=GENERATED_RIGHTS,
        card={"task": "rewrite a casual note in a formal or a pirate style",
              "sources": ["slot lexicons in engine.data.generators.text"],
              "preprocessing": "none",
              "known_gaps": ["template sentences: narrow vocabulary and syntax",
                             "two target styles only"],
              "intended_uses": ["teaching style transfer with LoRA", "SFT pipeline tests"],
              "prohibited_uses": ["claims about open-ended writing quality"]})
