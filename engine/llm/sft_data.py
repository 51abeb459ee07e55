"""SFT data: JSONL conversations -> (input_ids, labels) with only the assistant turns supervised.

Each line is `{"instruction": …, "response": …}` (optionally `"system"`) or
`{"messages": [...]}` with roles system/user/assistant/tool; the key names are configurable.
A malformed line is refused with its line number. A `text-sft` dataset folder (engine.data) is
read the same way, one split at a time. A record with a `tools` list (or any record under
format "tools") is a tool conversation, validated and encoded by engine/llm/tool_data.py.

Encoding: the conversation is rendered with the model's chat template, then
split at each assistant reply. Template text is tokenized with special tokens parsed; each reply
is tokenized *separately* and the ids concatenated, never the texts, so no BPE merge crosses the
boundary between prompt and reply. The reply's tokens and the template's end-of-turn marker that
follows it (e.g. `<end_of_turn>`, `<|im_end|>`) are supervised; everything else is masked.
Labels are the next-token shift: position i predicts token i+1.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from engine.errors import ForgebenchError
from engine.llm.chat import ROLES, ChatTemplate, encode_prompt
from engine.llm.tokenizer import GGUFTokenizer

__all__ = ["IGNORE_INDEX", "SFTKeys", "SFTExample", "EncodedSample", "SFTSummary",
           "load_sft_examples", "split_rendered", "encode_sft", "encode_sft_dataset",
           "encode_prompt", "mark_supervised", "inspect_samples", "data_source",
           "data_manifest", "has_split", "split_examples", "encode_samples", "jsonl_records",
           "example_of", "finish_sample", "eos_to_append"]

IGNORE_INDEX = -100                      # label of a position that is not supervised
Truncation = Literal["error", "truncate_response", "drop"]
TRUNCATIONS = ("error", "truncate_response", "drop")
_MARK = "\x00forgebench-reply-{}\x00"    # stands in for reply k while the template renders
_MARK_RE = re.compile("\x00forgebench-reply-(\\d+)\x00")


@dataclass(frozen=True)
class SFTKeys:
    """Field names in the records, and which shape to expect ("auto": either). The lm-sft
    config's `data` section has the same attribute names and can be passed instead."""

    instruction_key: str = "instruction"
    response_key: str = "response"
    messages_key: str = "messages"
    system_key: str = "system"
    format: Literal["auto", "pairs", "messages", "tools"] = "auto"


@dataclass
class SFTExample:
    messages: list[dict[str, str]]
    line: int                            # 1-based line (record number in a dataset folder)
    source: str = ""                     # the JSONL file
    where: str = ""                      # "line 7" or "record 'pirate-3'", for messages

    def __post_init__(self):
        self.where = self.where or f"line {self.line}"


@dataclass
class EncodedSample:
    input_ids: list[int]                 # sequence minus its last token
    labels: list[int]                    # next token where supervised, IGNORE_INDEX elsewhere
    truncated: bool
    line: int
    sequence: list[int]                  # every token, input_ids plus the last one

    @property
    def n_supervised(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass
class SFTSummary:
    examples: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    input_tokens: int = 0
    supervised_tokens: int = 0
    longest: int = 0                     # longest kept input
    dropped_lines: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def add(self, sample, line: int) -> bool:
        """Count one encoded example (None: dropped at `line`); True when it was kept."""
        if sample is None:
            self.dropped += 1
            self.dropped_lines.append(line)
            return False
        self.kept += 1
        self.truncated += sample.truncated
        self.input_tokens += len(sample.input_ids)
        self.supervised_tokens += sample.n_supervised
        self.longest = max(self.longest, len(sample.input_ids))
        return True


# ---------------------------------------------------------------------------------------------
# loading

def load_sft_examples(path: str | Path, keys: SFTKeys = SFTKeys(), system: str | None = None,
                      split: str | None = None) -> list[SFTExample]:
    """Read and validate a JSONL file of pairs or conversations, or one split of a text-sft
    dataset folder. `system` is a system message for records without one."""
    path = Path(path)
    if path.is_dir():
        return _dataset_examples(path, keys, system, split)
    examples = [example_of(record, keys, system, path, number, f"line {number}")
                for number, record in jsonl_records(path, "SFT data file")]
    if not examples:
        raise ForgebenchError("the SFT data file has no records", path=path,
                              hint="one JSON object per line")
    return examples


def jsonl_records(path: Path, what: str):
    """(line number, record) of each non-blank line of a JSONL file of objects; a line that is
    not UTF-8, not JSON or not an object is refused with its number."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ForgebenchError(f"{what} not found", path=path) from None
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ForgebenchError(f"not UTF-8 text (byte {exc.start})", path=path,
                                  where=where) from None
        except json.JSONDecodeError as exc:
            raise ForgebenchError(f"malformed JSON: {exc.msg} (column {exc.colno})", path=path,
                                  where=where, hint="each line must be one JSON object") from None
        if not isinstance(record, dict):
            raise ForgebenchError(f"expected a JSON object, got {type(record).__name__}",
                                  path=path, where=where)
        yield number, record


def example_of(record: dict, keys: SFTKeys, system: str | None, path: Path, number: int,
               where: str) -> SFTExample:
    """One record as an example: a tool conversation (a `tools` list, or format "tools";
    engine/llm/tool_data.py) or pairs / messages."""
    shape = getattr(keys, "format", "auto")
    if shape == "tools" or (shape == "auto" and "tools" in record):
        from engine.llm.tool_data import tool_example

        return tool_example(record, keys, system, path, number, where)
    return SFTExample(_messages_of(record, keys, system, path, where), number, str(path), where)


def _dataset_examples(root: Path, keys: SFTKeys, system: str | None,
                      split: str | None) -> list[SFTExample]:
    from engine.data.dataset import load_dataset

    dataset = load_dataset(root)
    if dataset.kind != "text-sft":
        raise ForgebenchError(f"dataset kind is {dataset.kind!r}, SFT needs 'text-sft'",
                              path=root / "dataset.json", where="kind")
    records_file = root / dataset.manifest.get("records", "records.jsonl")
    examples = []
    for number, record in enumerate(dataset.records(split), start=1):
        where = f"record {record.get('id', number)!r}"
        examples.append(example_of(record, keys, system, records_file, number, where))
    if not examples:
        raise ForgebenchError(f"the dataset has no records in split {split!r}", path=root,
                              hint="run `forgebench data split` or choose another split")
    return examples


def _text(value: Any, field_name: str, path: Path, where: str) -> str:
    if not isinstance(value, str):
        raise ForgebenchError(f"field '{field_name}' must be a string, got "
                              f"{type(value).__name__}", path=path, where=where)
    return value


def _turns_of(turns: Any, messages_key: str, path: Path, where: str) -> list[dict[str, str]]:
    """A record's {messages} list, checked: objects with a known role and string content, at
    least one assistant turn."""
    if not isinstance(turns, list) or not turns:
        raise ForgebenchError(f"field '{messages_key}' must be a non-empty list", path=path,
                              where=where)
    messages = []
    for k, turn in enumerate(turns):
        name = f"{messages_key}[{k}]"
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise ForgebenchError(f"field '{name}' must be an object with 'role' and "
                                  "'content'", path=path, where=where)
        if turn["role"] not in ROLES:
            raise ForgebenchError(f"field '{name}.role' is {turn['role']!r}", path=path,
                                  where=where, hint="roles: " + ", ".join(ROLES))
        messages.append({"role": turn["role"],
                         "content": _text(turn["content"], name + ".content", path, where)})
    if not any(m["role"] == "assistant" for m in messages):
        raise ForgebenchError("the conversation has no assistant turn, so nothing to learn",
                              path=path, where=where)
    return messages


def _messages_of(record: dict, keys: SFTKeys, system: str | None, path: Path,
                 where: str) -> list[dict[str, str]]:
    messages_key = keys.messages_key
    instruction_key, response_key = keys.instruction_key, keys.response_key
    system_key = getattr(keys, "system_key", "system")
    shape = getattr(keys, "format", "auto")
    if messages_key in record and shape != "pairs":
        messages = _turns_of(record[messages_key], messages_key, path, where)
    else:
        missing = [k for k in (instruction_key, response_key) if k not in record]
        if missing or shape == "messages":
            expected = f"'{messages_key}'" if shape == "messages" else \
                f"'{instruction_key}' and '{response_key}'" + \
                (f", or '{messages_key}'" if shape == "auto" else "")
            raise ForgebenchError(
                "missing field " + (" and ".join(f"'{k}'" for k in missing) or f"'{messages_key}'"),
                path=path, where=where,
                hint=f"records need {expected} (found: {', '.join(map(repr, record)) or 'none'})")
        messages = [
            {"role": "user", "content": _text(record[instruction_key], instruction_key, path,
                                              where)},
            {"role": "assistant", "content": _text(record[response_key], response_key, path,
                                                   where)}]
        if record.get(system_key) is not None:
            messages.insert(0, {"role": "system",
                                "content": _text(record[system_key], system_key, path, where)})
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


# ---------------------------------------------------------------------------------------------
# encoding

ChatRenderer = Callable[..., str]   # (messages, add_generation_prompt=...) -> text


def split_rendered(example: SFTExample, chat_renderer: ChatRenderer) -> tuple[list[str], list[str]]:
    """The rendered conversation as template text around each assistant reply:
    (texts, replies) with len(texts) == len(replies) + 1 that, interleaved, are exactly the
    renderer's text for the whole conversation."""
    replies = [m["content"] for m in example.messages if m["role"] == "assistant"]
    marked, k = [], 0
    for m in example.messages:
        if m["role"] == "assistant":
            m = dict(m, content=_MARK.format(k))
            k += 1
        marked.append(m)
    try:
        pieces = _MARK_RE.split(chat_renderer(marked, add_generation_prompt=False))
    except ForgebenchError as exc:   # name the record, not only the template
        raise ForgebenchError(exc.message, path=example.source, where=example.where,
                              hint=exc.hint or f"the template is the {exc.where}") from None
    texts, order = pieces[0::2], [int(i) for i in pieces[1::2]]
    if order != list(range(len(replies))):
        raise ForgebenchError("the chat template does not print each assistant reply once, in "
                              "order, so replies cannot be separated from the prompt",
                              path=example.source, where=example.where)
    real = chat_renderer(example.messages, add_generation_prompt=False)
    for candidate in (replies, [r.strip() for r in replies]):   # templates may trim replies
        if real == "".join(t + r for t, r in zip(texts, candidate)) + texts[-1]:
            return texts, candidate
    raise ForgebenchError("the chat template rewrites assistant replies (beyond trimming "
                          "whitespace), so their tokens cannot be aligned",
                          path=example.source, where=example.where)


def encode_sft(example: SFTExample, tokenizer: GGUFTokenizer, chat_renderer: ChatRenderer,
               max_len: int, truncation: Truncation = "error") -> EncodedSample | None:
    """Token ids and labels for one example; None when `truncation="drop"` drops it.

    `chat_renderer(messages, add_generation_prompt=False)` renders the conversation (a
    `ChatTemplate`; build it with enable_thinking=False for Qwen3 thinking off). `max_len` is
    the longest input (the sequence has one token more). Over-long samples are an error, cut at
    the end ("truncate_response", the prompt kept whole), or dropped.
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {TRUNCATIONS}")
    texts, replies = split_rendered(example, chat_renderer)
    ids = encode_prompt(tokenizer, texts[0])
    supervised = [False] * len(ids)
    for reply, after in zip(replies, texts[1:]):
        reply_ids = tokenizer.encode(reply, add_special=False, parse_special=False)
        after_ids = tokenizer.encode(after, add_special=False, parse_special=True)
        end = next((j for j, t in enumerate(after_ids) if t in tokenizer.eog_ids), None)
        if end is None:   # the template closes no turn: teach the model to stop with EOS
            reply_ids.append(eos_to_append(tokenizer, example))
            end = -1
        ids += reply_ids + after_ids
        supervised += [True] * (len(reply_ids) + end + 1) + [False] * (len(after_ids) - end - 1)
    return finish_sample(ids, supervised, example, max_len, truncation)


def eos_to_append(tokenizer, example: SFTExample) -> int:
    """The EOS that ends a reply when the chat template closes no turn."""
    if tokenizer.eos_id is None:
        raise ForgebenchError("the chat template ends no turn with an end-of-generation "
                              "token and the tokenizer has no EOS to append",
                              path=example.source, where=example.where)
    return tokenizer.eos_id


def finish_sample(ids: list[int], supervised: list[bool], example: SFTExample, max_len: int,
                  truncation: Truncation) -> EncodedSample | None:
    """The sample of a token sequence and which tokens are supervised, after the truncation
    policy (None: dropped)."""
    truncated = len(ids) - 1 > max_len
    if truncated:
        if truncation == "drop":
            return None
        if truncation == "error":
            raise ForgebenchError(
                f"sample is {len(ids) - 1} tokens, longer than max_len {max_len}",
                path=example.source, where=example.where,
                hint="raise max_len, or set truncation to 'truncate_response' or 'drop'")
        if not any(supervised[1:max_len + 1]):
            raise ForgebenchError(
                f"the prompt alone is {supervised.index(True)} tokens, so truncating to "
                f"max_len {max_len} leaves nothing to learn", path=example.source,
                where=example.where, hint="raise max_len, shorten the prompt, or drop it")
        ids, supervised = ids[:max_len + 1], supervised[:max_len + 1]
    labels = [t if s else IGNORE_INDEX for t, s in zip(ids[1:], supervised[1:])]
    if not any(supervised[1:]):
        raise ForgebenchError("the sample has no supervised tokens", path=example.source,
                              where=example.where, hint="give the assistant turn some text")
    return EncodedSample(ids[:-1], labels, truncated, example.line, ids)


def encode_sft_dataset(examples: list[SFTExample], tokenizer: GGUFTokenizer,
                       chat_renderer: ChatRenderer, max_len: int,
                       truncation: Truncation = "error") -> tuple[list[EncodedSample], SFTSummary]:
    """Encode every example; the summary counts kept, truncated and dropped samples."""
    samples, summary = [], SFTSummary(examples=len(examples))
    from engine.llm.tool_data import ToolExample, encode_tool_sft

    for example in examples:
        encode = encode_tool_sft if isinstance(example, ToolExample) else encode_sft
        sample = encode(example, tokenizer, chat_renderer, max_len, truncation)
        if summary.add(sample, example.line):
            samples.append(sample)
    return samples, summary


# ---------------------------------------------------------------------------------------------
# inspection

def mark_supervised(sample: EncodedSample, tokenizer: GGUFTokenizer,
                    open_mark: str = "\u27e6", close_mark: str = "\u27e7") -> str:
    """The sample's text with every supervised (predicted) token span between marks."""
    targets = [False] + [label != IGNORE_INDEX for label in sample.labels]
    runs: list[tuple[bool, bytearray]] = []
    for token, target in zip(sample.sequence, targets):
        if not runs or runs[-1][0] != target:
            runs.append((target, bytearray()))
        runs[-1][1].extend(tokenizer.token_bytes(token))
    return "".join(open_mark + text + close_mark if target else text
                   for target, text in ((t, b.decode("utf-8", "backslashreplace"))
                                        for t, b in runs))


def inspect_samples(model_path: str | Path, data_path: str | Path, keys: SFTKeys = SFTKeys(),
                    n: int = 3, max_len: int = 1024, truncation: Truncation = "error",
                    system: str | None = None, split: str | None = None,
                    enable_thinking: bool | None = False) -> dict[str, Any]:
    """Rendered samples with their supervised tokens marked, and the dataset's counts."""
    from engine.gguf.reader import open_gguf

    gguf_file = open_gguf(model_path)
    tokenizer = GGUFTokenizer.from_gguf(gguf_file)
    renderer = ChatTemplate.from_gguf(gguf_file, enable_thinking=enable_thinking)
    examples = load_sft_examples(data_path, keys, system, split)
    samples, summary = encode_sft_dataset(examples, tokenizer, renderer, max_len, truncation)
    shown = [{"line": s.line, "input_tokens": len(s.input_ids),
              "supervised_tokens": s.n_supervised, "truncated": s.truncated,
              "marked": mark_supervised(s, tokenizer),
              "input_ids": s.input_ids, "labels": s.labels} for s in samples[:n]]
    return {"model": str(model_path), "data": str(data_path), "template": renderer.origin,
            "tokenizer": tokenizer.describe(), "max_len": max_len, "truncation": truncation,
            "summary": summary.as_dict(), "samples": shown}


# -- the SFT data a recipe config names (lm-sft, lm-es: `config.data` is lm-sft's section) ----
def data_source(config, split: str = "train", what: str = "SFT data",
                kind: str = "text-sft") -> Path:
    """The JSONL file of a split, or the `kind` dataset folder that holds every split (`what`
    names the data in the error when it is missing)."""
    field_name = {"train": "path", "val": "val_path", "test": "test_path",
                  "control": "control_path"}[split]
    value = getattr(config.data, field_name)
    data_path = config.resolve_path(config.data.path, "field 'data.path'")
    if value is None and split != "train" and data_path.is_dir():
        value = config.data.path                # a dataset folder carries its own splits
    if value is None:
        raise ForgebenchError(f"the config names no {split} data",
                              where=f"field 'data.{field_name}'",
                              hint=f"add data.{field_name} = \"FILE.jsonl\"")
    path = config.resolve_path(value, f"field 'data.{field_name}'")
    if not path.exists():
        raise ForgebenchError(f"{what} not found", path=path, where=f"field 'data.{field_name}'",
                              hint=f"a JSONL file, or a {kind} dataset folder")
    return path


def has_split(config, split: str) -> bool:
    """Whether the config has data for `split`: a file of its own, or records of that split
    in the dataset folder `data.path` names."""
    if getattr(config.data, f"{split}_path", None):
        return True
    path = config.resolve_path(config.data.path, "field 'data.path'")
    if not path.is_dir():
        return False
    from engine.data.dataset import load_dataset

    return bool(load_dataset(path, check_media=False).records(split))


def split_examples(config, split: str = "train") -> list[SFTExample]:
    """The validated examples of one split: its JSONL file, or its records in the folder."""
    path = data_source(config, split)
    return load_sft_examples(path, config.data, config.data.system,
                             split=split if path.is_dir() else None)


def data_manifest(config) -> dict:
    """The data files and their SHA-256, and each dataset folder's version (which covers the
    dataset.json fields a run reads): what resume re-validates."""
    from engine.data.dataset import VERSION_SCHEME, load_dataset
    from engine.fsutil import sha256_file

    files, versions = {}, {}
    for split in ("train", "val", "test", "control"):
        if split != "train" and not getattr(config.data, f"{split}_path", None):
            continue
        path = data_source(config, split)
        if path.is_dir():
            dataset = load_dataset(path, check_media=False)
            files.update({f"{path.name}/{name}": digest
                          for name, digest in dataset.files_manifest().items()})
            versions[path.name] = dataset.version
        else:
            files[f"{split}:{path.name}"] = sha256_file(path)
    if versions:
        return {"files": files, "versions": versions, "version_scheme": VERSION_SCHEME}
    return {"files": files}


def encode_samples(config, base, split: str = "train"):
    """(encoded samples, summary counts) of one split, rendered with the base's template
    (`base.template`, `base.tokenizer`)."""
    d = config.data
    path = data_source(config, split)
    if getattr(config, "mode", "sft") == "cpt":
        from engine.llm.documents import load_documents, pack_documents

        documents = load_documents(path, d.text_key, split if path.is_dir() else None)
        blocks = pack_documents(documents, base.tokenizer, d.max_len)
        return blocks, {"documents": len(documents), "kept": len(blocks),
                        "input_tokens": sum(len(b.input_ids) for b in blocks),
                        "supervised_tokens": sum(b.n_supervised for b in blocks)}
    examples = split_examples(config, split)
    render = functools.partial(base.template.render, enable_thinking=d.enable_thinking)
    samples, summary = encode_sft_dataset(examples, base.tokenizer, render, d.max_len,
                                          d.truncation)
    if not samples:
        raise ForgebenchError("no sample is left to train on (all were dropped as too long)",
                              path=path, where="field 'data.truncation'", hint="raise data.max_len")
    return samples, summary.as_dict()
