"""The synthetic record corpus for `lm-pretrain`: short records about coloured household
objects in rooms, each followed by questions and answers about that record (the handbook's
tiny-transformer data, chapter 11, in Forgebench's own wording).

Every entity id belongs to exactly one split (train/val/test), so validation measures whether
the model learned the format and how to read a record, not whether it memorised one entity.
Deterministic for a given seed; dataset.json records split sizes, the seed and SHA-256 hashes,
with the rights and card statements every generated set carries.
"""

from __future__ import annotations

import random
from pathlib import Path

from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, staged_dataset_dir
from engine.errors import ForgebenchError

COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple", "grey",
           "brown")
ROOMS = ("kitchen", "office", "hall", "bedroom", "bathroom", "garage", "attic", "cellar",
         "study", "porch")
# object -> (state sentence template, state question template, the two states)
OBJECTS = {
    "lamp": ("Its switch is {}.", "Is the switch of {} on?", ("on", "off")),
    "fan": ("Its switch is {}.", "Is the switch of {} on?", ("on", "off")),
    "radio": ("Its switch is {}.", "Is the switch of {} on?", ("on", "off")),
    "kettle": ("Its switch is {}.", "Is the switch of {} on?", ("on", "off")),
    "mug": ("It is {}.", "Is {} full?", ("full", "empty")),
    "vase": ("It is {}.", "Is {} full?", ("full", "empty")),
    "jar": ("It is {}.", "Is {} full?", ("full", "empty")),
    "box": ("It is {}.", "Is {} open?", ("open", "closed")),
    "book": ("It is {}.", "Is {} open?", ("open", "closed")),
    "drawer": ("It is {}.", "Is {} open?", ("open", "closed")),
}
SPLITS = (("train", 0.8), ("val", 0.1), ("test", 0.1))
QUESTIONS = ("where", "color", "state")


def record_text(entity: str, rng: random.Random, questions: tuple[str, ...] = QUESTIONS) -> str:
    """One record and its questions (the kinds `questions` names, in a shuffled order), on one
    line."""
    obj = rng.choice(sorted(OBJECTS))
    colour, room = rng.choice(COLOURS), rng.choice(ROOMS)
    state_sentence, state_question, states = OBJECTS[obj]
    state = rng.choice(states)
    asked = {
        "where": (f"Where is {entity}?", f"the {room}."),
        "color": (f"What color is {entity}?", f"{colour}."),
        "state": (state_question.format(entity), "yes." if state == states[0] else "no."),
    }
    pairs = [asked[kind] for kind in QUESTIONS if kind in questions]
    rng.shuffle(pairs)
    qa = " ".join(f"Question: {q} Answer: {a}" for q, a in pairs)
    return (f"Record {entity}: the {colour} {obj} is in the {room}. "
            f"{state_sentence.format(state)} {qa}")


def generate_records(out_dir: str | Path, n: int = 1000, seed: int = 0,
                     questions: tuple[str, ...] = QUESTIONS) -> Path:
    """Write `n` entity records split 80/10/10 by entity into train.txt, val.txt, test.txt,
    with dataset.json (kind text-corpus) holding sizes, seed, provenance, rights, the card
    statement and SHA-256 hashes. `questions` picks which questions follow each record
    (`forgebench demo` asks only "where")."""
    if n < 10:
        raise ForgebenchError(f"need at least 10 entities for three splits, got {n}",
                              where="--n")
    unknown = sorted(set(questions) - set(QUESTIONS))
    if unknown or not questions:
        raise ForgebenchError(f"unknown question kinds {unknown}" if unknown
                              else "no question kinds given", where="--questions",
                              hint=f"choose from {', '.join(QUESTIONS)}")
    with staged_dataset_dir(out_dir) as root:
        rng = random.Random(seed)
        entities = [f"item{i:04d}" for i in range(n)]
        rng.shuffle(entities)
        bounds, start = {}, 0
        for split, share in SPLITS:
            count = round(n * share) if split != "test" else n - start
            bounds[split] = entities[start:start + count]
            start += count
        splits = {}
        for split, ids in bounds.items():
            text = "".join(record_text(entity, rng, questions) + "\n"
                           for entity in sorted(ids))
            (root / f"{split}.txt").write_text(text, encoding="utf-8")
            splits[split] = {"file": f"{split}.txt", "entities": len(ids),
                             "bytes": len(text.encode("utf-8"))}
        write_manifest(
            root, "text-corpus", "records",
            description="synthetic records about coloured household objects in rooms, each "
                        "followed by questions and answers; entity-disjoint splits",
            splits=splits,
            split_policy={"method": "by entity", "group": "entity id",
                          "ratios": dict(SPLITS), "seed": seed},
            provenance={"generator": "engine.data.generators.records", "n": n, "seed": seed,
                        **({} if questions == QUESTIONS else {"questions": list(questions)})},
            rights=GENERATED_RIGHTS,
            card={"task": "pretrain a tiny decoder to read a record and answer questions "
                          "about it",
                  "sources": ["procedural text by engine.data.generators.records"],
                  "preprocessing": "none: one record and its questions per line",
                  "known_gaps": ["one template: 10 objects, 10 colours, 10 rooms, 2 states",
                                 "English only; says nothing about open text"],
                  "intended_uses": ["the lm-pretrain demo: a tiny transformer learning a "
                                    "format and to read a record"],
                  "prohibited_uses": ["claims about general language modelling"]})
    return Path(out_dir).expanduser().absolute()
