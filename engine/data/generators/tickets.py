"""The fictional support-ticket decisions for `lm-decision` (handbook chapters 23-24): which
queue should look at a ticket, from a closed set of four (billing, delivery, access, review).

A ticket is built from slot lexicons: an opener, one or two evidence sentences and sometimes an
irrelevant aside. Most tickets carry the evidence of one queue. A fifth of them mention two
queues' problems at once; for those the recorded queue is drawn 50/50 between the two, the way
two human triagers disagree, so no model can be right on them more than about half the time and
a calibrated model should say about 0.5. Vague tickets without evidence go to review.

Each record offers three or four of the queues (the right one always among them) in a shuffled
order, with the target the right option's id, so the position of an option says nothing. A
group is one customer conversation: the ticket asked with two or three paraphrased questions
and asides, all in one split (block split of the groups: train 60%, val 15%, calibration 10%,
test 15%), so validation, the temperature fit and the test never see a training conversation.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir
from engine.data.splits import block_split
from engine.errors import ForgebenchError

# the closed option schema (dataset.json "options"): the Laya example's queues (chapter 23)
QUEUES = [{"id": "billing", "text": "Payments, receipts, invoices, unexpected charges"},
          {"id": "delivery", "text": "Couriers, tracking, late or missing parcels"},
          {"id": "access", "text": "Passwords, sign-in, locked accounts"},
          {"id": "review", "text": "Insufficient information or a different problem"}]
RATIOS = {"train": 0.6, "val": 0.15, "calibration": 0.1, "test": 0.15}
MIXED_SHARE = 0.2     # tickets with two queues' evidence, their queue drawn 50/50
VAGUE_SHARE = 0.12    # tickets with no evidence: review

EVIDENCE = {
    "billing": ["I was charged twice for order {n}.", "My invoice shows the wrong amount.",
                "The receipt for order {n} lists a fee I never agreed to.",
                "My card was billed after I cancelled the subscription.",
                "I paid {price} but the invoice says {price2}.",
                "There is an unexpected charge on my statement from you.",
                "The refund for order {n} has not reached my account."],
    "delivery": ["The courier left my parcel at the wrong building.",
                 "Order {n} shows delivered but nothing arrived.",
                 "The tracking page for order {n} has not moved for a week.",
                 "My parcel arrived damaged and half empty.",
                 "The delivery is three days late.",
                 "The driver said the address could not be found.",
                 "My package went to a neighbour I do not know."],
    "access": ["I cannot sign in since the last update.",
               "My account is locked after three wrong passwords.",
               "The password reset email never comes.",
               "The app says my login code has expired every time.",
               "Someone changed my password and I cannot get in.",
               "Two-factor sign-in keeps rejecting my code.",
               "I forgot which email I used to sign in."],
}
VAGUE = ["Something is not right, please look into it.", "I have a problem with you people.",
         "Can someone call me back about this?", "This is the second time I am writing.",
         "Nothing works the way it should.", "Please fix it, I do not know what happened."]
OPENERS = ["Hello,", "Hi team,", "Good morning.", "Dear support,", "Hey,", ""]
ASIDES = ["I have been a customer for years.", "The weather here is terrible today.",
          "My cat walked over the keyboard twice while I wrote this.", "Thanks in advance.",
          "I am writing from my phone.", "This is urgent for me."]
QUESTIONS = ["Which team should investigate this request?", "Which queue should review this?",
             "Where should this ticket go?"]


def _ticket(rng: random.Random, kind: str, queues: tuple[str, ...]) -> str:
    slots = {"n": rng.randint(1000, 9999), "price": f"{rng.randint(5, 90)}.00 EUR",
             "price2": f"{rng.randint(91, 200)}.00 EUR"}
    if kind == "vague":
        sentences = [rng.choice(VAGUE)]
    else:
        sentences = [rng.choice(EVIDENCE[q]).format(**slots) for q in queues]
    return " ".join(s for s in [rng.choice(OPENERS), *sentences] if s)


def ticket_records(n: int = 400, seed: int = 0) -> list[dict]:
    """About `n` decision records in conversation groups of two or three."""
    rng = random.Random(seed)
    evident = sorted(EVIDENCE)
    records: list[dict] = []
    group_index = 0
    while len(records) < n:
        roll = rng.random()
        if roll < VAGUE_SHARE:
            kind, queues, label = "vague", (), "review"
        elif roll < VAGUE_SHARE + MIXED_SHARE:
            kind, queues = "mixed", tuple(rng.sample(evident, 2))
            label = rng.choice(queues)        # two triagers disagree: either queue
        else:
            kind, queues = "clear", (rng.choice(evident),)
            label = queues[0]
        ticket = _ticket(rng, kind, queues)
        group = f"ticket-{group_index:04d}"
        split = block_split(group_index, seed, RATIOS)
        for turn in range(rng.randint(2, 3)):
            if len(records) == n:
                break
            others = [q["id"] for q in QUEUES if q["id"] != label]
            offered = [label, *rng.sample(others, rng.choice((2, 3)))]
            rng.shuffle(offered)
            text = {q["id"]: q["text"] for q in QUEUES}
            state = ticket if turn == 0 else f"{ticket} {rng.choice(ASIDES)}"
            records.append({"id": f"{group}-{turn}", "group": group, "split": split,
                            "state": state, "question": rng.choice(QUESTIONS),
                            "options": [{"id": o, "text": text[o]} for o in offered],
                            "label": label, "evidence": kind,
                            "source": "forgebench ticket generator", "rights": RECORD_RIGHTS})
        group_index += 1
    return records


def generate_tickets(out_dir: str | os.PathLike, n: int = 400, seed: int = 0) -> Path:
    """Write `n` ticket decisions (records.jsonl) with dataset.json (kind decisions, the queue
    schema, split policy, provenance, rights and card)."""
    if n < 40:
        raise ForgebenchError(f"need at least 40 records to fill four splits, got {n}",
                              where="--n")
    with staged_dataset_dir(out_dir) as root:
        records = ticket_records(n, seed)
        (root / "records.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
            encoding="utf-8")
        write_manifest(
            root, "decisions", "tickets", records="records.jsonl", options=QUEUES,
            split_policy={"method": "block", "ratios": RATIOS, "seed": seed,
                          "group_field": "group"},
            provenance={"generator": "engine.data.generators.tickets", "n": n, "seed": seed},
            slices=["evidence"], rights=GENERATED_RIGHTS,
            card={"task": "suggest the support queue of a fictional ticket (a recommendation "
                          "shown beside the ticket, never an action)",
                  "sources": ["slot lexicons in engine.data.generators.tickets"],
                  "preprocessing": "none",
                  "known_gaps": ["template sentences in English: narrow wording",
                                 f"{MIXED_SHARE:.0%} of tickets carry two queues' evidence and "
                                 "a 50/50 queue: irreducible error by design"],
                  "intended_uses": ["the lm-decision demo: an option-pointer head, "
                                    "temperature calibration and abstention"],
                  "prohibited_uses": ["routing real customer requests"]})
    return Path(out_dir).expanduser().absolute()
