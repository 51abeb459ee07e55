"""Help-desk retrieval sets (kind "retrieval"): fictional products, their help articles, and
support questions judged against them (the handbook's chapter 16 fixture, in our own words).

Two variants share one topic table:

* `easy` is the handbook's wiring fixture: 10 products x 6 articles = 60 documents, three
  questions per article worded close to the article, products split 6/2/2. A TF-IDF baseline
  does well on it, which is the point: a neural model has to earn its place.
* `hard` adds what makes search hard, by design:
  - every article has a *distractor* in the same product that shares the question's words but
    does not answer it ("Renewal reminders" next to "Cancel a subscription");
  - questions are paraphrases that avoid the article's own words ("stop future renewals");
  - every product has the same articles, so the product name in the question is the only
    thing that tells two products' otherwise parallel articles apart;
  - the menu names differ per product, so no two products' articles are identical strings.
  12 products x 16 documents = 192 documents, products split 8/2/2.

Each product (the `group`) lives in one split; a question takes its article's split. Every
document stays in the index whatever its split (held-out documents are the database searched
at inference time; only train questions ever update weights). Deterministic for a seed.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from engine.data.dataset import write_manifest
from engine.data.generators import GENERATED_RIGHTS, RECORD_RIGHTS, staged_dataset_dir
from engine.data.retrieval import QUERIES_FILE
from engine.errors import ForgebenchError

PRODUCTS = ("Aster", "Birchwell", "Cobalt", "Dunmore", "Embergate", "Fjordly", "Garnetta",
            "Heronet", "Iris", "Juniperon", "Kestrel", "Lumenor")

# Menu words differ per product (drawn per product), so parallel articles are not copies.
MENUS = {"billing": ("Billing", "Payments", "Plan and invoices", "Subscription"),
         "account": ("Account", "Profile", "My settings", "Personal"),
         "security": ("Security", "Sign-in and safety", "Protection", "Login options"),
         "data": ("Data", "Storage", "Records", "Library"),
         "people": ("Members", "Team", "People", "Workspace users")}

# topic -> article (title, body), the easy questions (close to the article), the hard
# questions (paraphrases, mostly in the distractor's words) and the distractor article.
TOPICS = {
    "cancel": {
        "title": "Cancel a subscription",
        "body": "Open {billing}, choose Cancel subscription and confirm. Access continues "
                "until the end of the paid period and nothing is charged afterwards.",
        "easy": ["How do I cancel the subscription in {p}?", "{p} paid period",
                 "I want to stop paying for {p}."],
        "hard": ["In {p}, I need to stop future renewals.",
                 "How can I make sure my {p} plan never renews and charges me again?",
                 "{p} keeps renewing my plan every month; I want it to end."],
        "distractor": ("Renewal reminders", "{p} emails you seven days before your plan "
                       "renews so you can check the charge. Change the reminder under "
                       "{billing}; the renewal itself goes ahead as planned."),
    },
    "password": {
        "title": "Change the password",
        "body": "Open {account} then {security} and choose Change password. Type the old "
                "one once and the new one twice.",
        "easy": ["How do I change the password in {p}?", "{p} sign-in change",
                 "I forgot the password I use for {p}."],
        "hard": ["My {p} sign-in secret feels weak; how do I pick another one?",
                 "How do I swap the passphrase I use to log in to {p}?",
                 "Where does {p} let me replace the login word I type every morning?"],
        "distractor": ("Password rules", "Every {p} password needs twelve characters. Your "
                       "administrator may ask you to log in with a new password every "
                       "ninety days; weak sign-in secrets are refused."),
    },
    "export": {
        "title": "Export your data",
        "body": "Go to {data} and press Export archive. {p} sends a ZIP file with every record "
                "to your email within an hour.",
        "easy": ["How do I export my data from {p}?", "{p} ZIP file",
                 "Can I take my records out of {p}?"],
        "hard": ["How can I keep a copy of everything I stored in {p} on my own computer?",
                 "I want to back up all my {p} files before I leave.",
                 "Can I download all the information {p} holds about my work?"],
        "distractor": ("Import files", "Bring files from another tool into {p}: upload them "
                       "under {data}. Large uploads keep a copy of the original on our "
                       "servers until the import finishes."),
    },
    "recovery": {
        "title": "Recover access with a recovery code",
        "body": "If the authenticator app is gone, enter one of your recovery codes on the "
                "sign-in screen, then register the new device under {security}.",
        "easy": ["How do I use a recovery code in {p}?", "{p} authenticator gone",
                 "I lost my phone and cannot sign in to {p}."],
        "hard": ["I got a new phone and {p} still asks for the code from the old one.",
                 "My handset with the {p} verification app was stolen; how do I get in?",
                 "{p} wants a two-step verification code but my phone broke."],
        "distractor": ("Turn on two-step verification", "In {security}, choose Two-step "
                       "verification and scan the code with the app on your phone. From then "
                       "on {p} asks for a code from that phone at every sign-in."),
    },
    "invite": {
        "title": "Invite a teammate",
        "body": "Open {people} and press Invite. The person receives an email link and joins "
                "with the role you pick.",
        "easy": ["How do I invite a teammate to {p}?", "{p} email link role",
                 "How do I add a colleague to {p}?"],
        "hard": ["How does a new colleague get into our {p} workspace?",
                 "Our team hired someone; how do they start working with us in {p}?",
                 "I'd like a coworker to see the projects our team keeps in {p}."],
        "distractor": ("Remove a member", "Open {people}, pick the person and press Remove. "
                       "Their projects stay in the {p} workspace and the team keeps working "
                       "on them."),
    },
    "refund": {
        "title": "Request a refund",
        "body": "Write to support within 14 days of the payment with the invoice number; "
                "refunds go back to the original card.",
        "easy": ["How do I request a refund from {p}?", "{p} original card",
                 "Can {p} give my money back?"],
        "hard": ["{p} billed me twice by mistake; can I get my money back?",
                 "I was charged for {p} after I stopped using it; how do I get it returned?",
                 "Can {p} give back the charge from last week?"],
        "distractor": ("Download invoices", "Every charge in {p} creates an invoice under "
                       "{billing}. Open a charge to see the money billed and download it as "
                       "a PDF."),
    },
    "delete": {
        "title": "Delete your account",
        "body": "Open {account}, choose Delete account and confirm with your password. All "
                "content is erased after 30 days.",
        "easy": ["How do I delete my account in {p}?", "Delete account {p}",
                 "I need to delete my {p} account."],
        "hard": ["I want {p} to forget me completely.",
                 "How do I make {p} wipe my profile and everything in it for good?",
                 "Please remove me and my stuff from {p} forever."],
        "distractor": ("Sign out everywhere", "Open {account} and press Sign out on all "
                       "devices. {p} keeps your profile and everything in it; you simply "
                       "sign in again."),
    },
    "offline": {
        "title": "Work offline",
        "body": "Turn on Offline mode in {account}. Edits are stored on the device and "
                "upload when you are back online.",
        "easy": ["How do I work offline in {p}?", "{p} offline mode",
                 "I want to use {p} offline."],
        "hard": ["Can I keep editing in {p} on a plane without wifi?",
                 "Will {p} still work when my internet connection drops?",
                 "I travel a lot without a connection; can {p} keep my changes?"],
        "distractor": ("Sync troubleshooting", "If changes made in {p} do not appear on "
                       "another device, check the internet connection and press Sync now; "
                       "the wifi must allow uploads."),
    },
}
EASY_TOPICS = ("cancel", "password", "export", "recovery", "invite", "refund")
VARIANTS = {"easy": {"products": 10, "topics": EASY_TOPICS, "ratios": (6, 2, 2)},
            "hard": {"products": 12, "topics": tuple(TOPICS), "ratios": (8, 2, 2)}}


def help_articles(variant: str = "hard", seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(documents, queries) of one variant."""
    if variant not in VARIANTS:
        raise ForgebenchError(f"unknown variant {variant!r}", where="--variant",
                              hint="use one of " + ", ".join(VARIANTS))
    spec = VARIANTS[variant]
    rng = random.Random(f"{seed}-{variant}")
    products = list(PRODUCTS[:spec["products"]])
    rng.shuffle(products)
    n_train, n_val, _ = spec["ratios"]
    split_of = {p: "train" if i < n_train else "val" if i < n_train + n_val else "test"
                for i, p in enumerate(products)}
    docs, queries = [], []
    for product in sorted(products):
        menus = {slot: rng.choice(options) for slot, options in MENUS.items()}
        split = split_of[product]
        slug = product.lower()
        for topic in spec["topics"]:
            entry = TOPICS[topic]
            doc_id = f"{slug}-{topic}"
            docs.append(_doc(doc_id, product, entry["title"], entry["body"], menus, split))
            if variant == "hard":
                title, body = entry["distractor"]
                docs.append(_doc(f"{doc_id}-near", product, title, body, menus, split))
            for k, question in enumerate(entry[variant]):
                queries.append({"query_id": f"{doc_id}-q{k}", "text": question.format(p=product),
                                "relevant_doc_ids": [doc_id], "split": split,
                                "kind": variant})
    return docs, queries


def _doc(doc_id: str, product: str, title: str, body: str, menus: dict, split: str) -> dict:
    text = f"{product}: {title}. " + body.format(p=product, **menus)
    return {"doc_id": doc_id, "title": title, "text": text, "group": product, "split": split,
            "source": "forgebench help-article generator", "rights": RECORD_RIGHTS}


def generate_help_articles(out_dir: str | os.PathLike, variant: str = "hard",
                           seed: int = 0) -> Path:
    """Write corpus.jsonl, queries.jsonl and dataset.json (kind retrieval)."""
    docs, queries = help_articles(variant, seed)
    spec = VARIANTS[variant]
    with staged_dataset_dir(out_dir) as root:
        for name, rows in (("corpus.jsonl", docs), (QUERIES_FILE, queries)):
            (root / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                             for r in rows), encoding="utf-8")
        write_manifest(
            root, "retrieval", f"help-articles-{variant}", records="corpus.jsonl",
            queries=QUERIES_FILE,
            split_policy={"method": "by product", "group_field": "group",
                          "products": dict(zip(("train", "val", "test"), spec["ratios"])),
                          "seed": seed},
            provenance={"generator": "engine.data.generators.retrieval", "variant": variant,
                        "seed": seed, "documents": len(docs), "queries": len(queries)},
            rights=GENERATED_RIGHTS,
            card={"task": "retrieve the help article that answers a support question for the "
                          "right product",
                  "sources": ["topic table in engine.data.generators.retrieval"],
                  "preprocessing": "none",
                  "known_gaps": ["shared templates across products: a wiring and comparison "
                                 "fixture, not a retrieval benchmark",
                                 "one relevant article per question; English only"],
                  "intended_uses": ["embed-retrieval: TF-IDF baseline against a fine-tuned "
                                    "encoder"],
                  "prohibited_uses": ["claims about real help-desk search quality"]})
    return Path(out_dir).expanduser().absolute()
