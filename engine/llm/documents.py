"""Raw documents for continued pretraining (lm-sft's `mode = "cpt"`): read, tokenize, and pack
into blocks where every token is supervised.

A documents file is JSONL with one `{"text": ...}` object per line (the key is configurable;
other fields such as `source_id` are kept out of the text), a `text-corpus` dataset folder
(its documents.jsonl), or any other file read whole as one plain-text document (a control
text). A line without a non-empty string text is refused with its line and field.

Packing: each document's tokens (no special tokens parsed: raw text cannot inject markup) are
followed by EOS, the documents are laid end to end in file order, and the stream is cut into
blocks of `block_len` tokens. Each block starts with BOS when the tokenizer wants one, so
every block reads like the start of a text to the model; it attends only within itself
(engine.train.lm_base.pack), and every next token is a target, EOS included, so the model
learns where documents end. The last, shorter block is kept.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import ForgebenchError
from engine.llm.sft_data import EncodedSample, jsonl_records


def _corpus_documents(path: Path, split: str | None) -> list[str]:
    """The documents of one split of a text-corpus dataset folder."""
    from engine.data.dataset import load_dataset

    dataset = load_dataset(path)
    if dataset.kind != "text-corpus":
        raise ForgebenchError(f"dataset kind is {dataset.kind!r}, continued pretraining "
                              "needs 'text-corpus'", path=path / "dataset.json",
                              where="kind")
    documents = [record["text"] for record in dataset.records(split)]
    if not documents:
        raise ForgebenchError(f"the dataset has no documents in split {split!r}",
                              path=path, hint="run `forgebench data split`")
    return documents


def _text_file(path: Path) -> str:
    """A plain text file as one document (UTF-8, not empty)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ForgebenchError("documents file not found", path=path) from None
    except UnicodeDecodeError as exc:
        raise ForgebenchError(f"not UTF-8 text (byte {exc.start})", path=path) from None
    if not text.strip():
        raise ForgebenchError("the text file is empty", path=path)
    return text


def load_documents(path: Path, text_key: str = "text", split: str | None = None) -> list[str]:
    """The documents of a file, or of one split of a text-corpus folder, in order."""
    path = Path(path)
    if path.is_dir():
        return _corpus_documents(path, split)
    if path.suffix != ".jsonl":
        return [_text_file(path)]
    documents = []
    for number, record in jsonl_records(path, "documents file"):
        text = record.get(text_key)
        if not isinstance(text, str) or not text.strip():
            got = "missing" if text_key not in record else f"a {type(text).__name__}" \
                if not isinstance(text, str) else "empty"
            raise ForgebenchError(f"field '{text_key}' must be a non-empty string ({got})",
                                  path=path, where=f"line {number}",
                                  hint=f'one {{"{text_key}": "..."}} object per line')
        documents.append(text)
    if not documents:
        raise ForgebenchError("the documents file has no records", path=path,
                              hint=f'one {{"{text_key}": "..."}} object per line')
    return documents


def pack_documents(documents: list[str], tokenizer, block_len: int) -> list[EncodedSample]:
    """Blocks of at most `block_len` input tokens over the EOS-separated documents."""
    if tokenizer.eos_id is None:
        raise ForgebenchError("the tokenizer has no EOS token to separate documents",
                              where="field 'mode'")
    stream: list[int] = []
    for text in documents:
        stream += tokenizer.encode(text, add_special=False, parse_special=False)
        stream.append(tokenizer.eos_id)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    # a block of block_len inputs holds one token more; without BOS, blocks overlap by that one
    # token so that every token after the first is a target once
    body = block_len + 1 - len(bos)
    blocks = []
    for number, start in enumerate(range(0, len(stream), block_len), start=1):
        sequence = bos + stream[start:start + body]
        if len(sequence) < 2:
            continue
        blocks.append(EncodedSample(sequence[:-1], sequence[1:], False, number, sequence))
    return blocks
