"""The dataset kinds and their record formats: one table the validator, the loader and the
generators all read, so a format cannot drift between writer and reader.

A dataset is a folder holding `dataset.json`::

    {"kind": "image-masks", "schema_version": 1, "name": "shapes",
     "version": "<sha256 prefix over files and the fields a run reads>", "version_scheme": 2,
     "parent": null,
     "files": {"records.jsonl": "<sha256>", "images/a.png": "<sha256>", ...},
     "records": "records.jsonl",                       # optional, the kind's default otherwise
     "split_policy": {"method": "group-hash", "ratios": {...}, "seed": 0, "group_field": "group"},
     "classes": [...], "image": {"mode": "RGB", "size": [64, 64]},
     "audio": {"sample_rate": 16000, "channels": 1, "subtype": "PCM_16", "samples": 8192},
     "provenance": {...}, "rights": {...}, "card": {...}}
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA_VERSION = 1
MANIFEST = "dataset.json"
SPLITS_FILE = "splits.json"  # group -> split assignments written by `forgebench data split`
CARD_FILES = ("card.json", "card.md")  # descriptions, not data: never hashed
SPLITS = ("train", "val", "calibration", "test")
EMPTY_LABEL = "empty"  # image-masks / image-boxes: the scene holds no object (no box)
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")

# Field types understood by the validator (engine.data.validate checks each one).
TEXT = "text"        # non-empty string
STR = "str"          # any string
ID = "id"            # non-empty string, unique in the dataset
PATH = "path"        # relative path inside the dataset folder, listed in dataset.json files
LABEL = "label"      # string, one of the manifest's classes when it declares them
SPLIT = "split"      # one of SPLITS
BOX = "box"          # null or normalized [x0, y0, x1, y1] with 0 <= x0 < x1 <= 1
MESSAGES = "messages"  # [{"role": ..., "content": ...}, ...]
SHA256 = "sha256"    # 64 lowercase hex digits, must match the file in `path`
RIGHTS = "rights"    # string or object
OUTCOME = "outcome"  # one of OUTCOMES
OUTCOMES = ("preferred", "tie", "skip")   # a preference pair's judgement; ties and skips teach
                                          # nothing and are left out of training (counted)
TOOLS = "tools"      # a tool-call conversation's tool schemas: the whole record (its calls
                     # against these schemas) is checked by engine.data.tool_records
OPTIONS = "options"  # [{"id", "text"}, ...]: two or more, ids unique and in the manifest's
                     # closed option schema ("options" in dataset.json) when it declares one

COMMON_FIELDS = {"id": ID, "group": STR, "split": SPLIT, "source": STR, "rights": RIGHTS}


@dataclass(frozen=True)
class Kind:
    """One dataset kind: where its records live and which fields they carry."""

    name: str
    records: str                      # default records file (JSONL, or CSV for .csv)
    fields: dict[str, str]            # field -> type, beyond COMMON_FIELDS
    required: tuple[str, ...]         # always required
    one_of: tuple[tuple[str, ...], ...] = ()  # exactly one of these field sets is required
    id_from: str | None = None        # field that stands in for a missing id
    text_fields: tuple[str, ...] = ()  # model-visible text (leaks, lengths)
    labelled: bool = False
    media: str | None = None          # "image" or "audio": format checks apply; "files":
                                      # only that each path is a listed file
    alt_records: tuple[str, ...] = field(default=())  # other accepted records files
    distinct: tuple[str, ...] = ()    # fields whose values must differ within a record
    chosen_from: tuple[str, str] | None = None  # (answer field, options field): the answer
                                                # must name one of the record's option ids

    @property
    def path_fields(self) -> tuple[str, ...]:
        """Fields naming files in the folder (checked to be listed; absolute Paths on load)."""
        return tuple(name for name, ftype in self.fields.items() if ftype == PATH)


KINDS: dict[str, Kind] = {k.name: k for k in [
    # pairs or conversations; a conversation with `tools` is a tool-call SFT record
    Kind("text-sft", "records.jsonl",
         {"instruction": TEXT, "response": TEXT, "messages": MESSAGES, "system": STR,
          "tools": TOOLS},
         required=("id",), one_of=(("instruction", "response"), ("messages",)),
         text_fields=("system", "instruction", "response", "messages")),
    Kind("text-corpus", "documents.jsonl", {"text": TEXT},
         required=("id", "text"), text_fields=("text",)),
    # pairwise preferences (blind A/B exports, lm-dpo's data): who rated, in which session and
    # why are kept per pair, so pairs from several raters keep their provenance
    Kind("preferences", "records.jsonl",
         {"prompt": TEXT, "chosen": TEXT, "rejected": TEXT, "system": STR, "rater": STR,
          "session": STR, "rationale": STR, "outcome": OUTCOME},
         required=("id", "prompt", "chosen", "rejected"),
         text_fields=("system", "prompt", "chosen", "rejected"), distinct=("chosen", "rejected")),
    # preferences between generated images or sounds (blind A/B exports): the files are copied
    # into the dataset folder and listed with their SHA-256
    Kind("media-preferences", "records.jsonl",
         {"prompt": TEXT, "chosen": PATH, "rejected": PATH},
         required=("id", "prompt", "chosen", "rejected"), text_fields=("prompt",),
         media="files"),
    Kind("image-classify", "records.jsonl", {"image": PATH, "label": LABEL},
         required=("image", "label"), id_from="image", labelled=True, media="image"),
    Kind("image-masks", "records.jsonl",
         {"image": PATH, "mask": PATH, "label": LABEL, "box": BOX},
         required=("id", "image", "mask"), labelled=True, media="image"),
    Kind("image-boxes", "records.jsonl",
         {"image": PATH, "mask": PATH, "label": LABEL, "box": BOX},
         required=("id", "image", "box"), labelled=True, media="image"),
    Kind("captioned-images", "metadata.jsonl", {"file_name": PATH, "text": TEXT},
         required=("file_name", "text", "group"), id_from="file_name", text_fields=("text",),
         media="image"),
    Kind("audio-clips", "clips.jsonl",
         {"path": PATH, "label": LABEL, "sha256": SHA256},
         required=("path", "label", "split", "group", "source", "rights", "sha256"),
         id_from="path", labelled=True, media="audio", alt_records=("clips.csv",)),
    # a typed decision (lm-decision): a request, a question and a closed set of options, with
    # the id of the right one; dataset.json's "options" is the schema every id must come from
    Kind("decisions", "records.jsonl",
         {"state": TEXT, "question": TEXT, "options": OPTIONS, "label": ID},
         required=("id", "state", "question", "options", "label"),
         text_fields=("state", "question"), chosen_from=("label", "options")),
    # a search corpus (documents with their group, e.g. the product) plus its judged queries
    # in queries.jsonl (checked by engine.data.retrieval: each query names its relevant
    # documents and takes their split)
    Kind("retrieval", "corpus.jsonl", {"doc_id": ID, "text": TEXT, "title": STR},
         required=("doc_id", "text", "group"), id_from="doc_id", text_fields=("text",)),
    # one row per example; the columns (features, target, group) are declared in dataset.json's
    # `table` section and checked by engine.data.tabular
    Kind("tabular", "rows.csv", {}, required=("id",)),
    # one utterance per row: a WAV and its transcript (empty for a clip without speech), who
    # spoke and in which recording session; the transcript policy is dataset.json's
    # `transcripts` section and checked by engine.data.speech
    Kind("speech", "utterances.jsonl",
         {"path": PATH, "text": STR, "speaker": STR, "session": STR, "sha256": SHA256},
         required=("id", "path", "text", "speaker", "session", "group"), text_fields=("text",),
         media="audio"),
]}


def kind_names() -> list[str]:
    return sorted(KINDS)
