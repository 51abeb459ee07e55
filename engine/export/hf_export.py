"""A trained model as a merged Hugging Face folder: `forgebench export RUN --format hf --out DIR`.

The folder `transformers` (and vLLM or any HF-compatible server) loads: `config.json`,
`generation_config.json`, the tokenizer files with the chat template the run trained with in
`tokenizer_config.json`, the weights as f32 safetensors shards (`model-0000N-of-0000M.safetensors`
+ `model.safetensors.index.json`, shards of at most `--shard-size`), and `README.md`, a model
card.

The weights are the run's merged dense GGUF (engine.export.bundle at f32: LoRA merged into the
base, or a full fine-tune's weights) mapped back to Hugging Face's layout, undoing what
llama.cpp's converter does (engine.hf.convert): Llama's Q/K row permutation, Gemma 3's +1 on
its norms, the GGUF tensor names. The configuration and tokenizer come from the base's
Hugging Face folder — the one `forgebench models add DIR` recorded for the run's base (found in
the workspace library by the base's SHA-256), or `--hf-source DIR` — since a GGUF does not keep
the tokenizer files a `transformers` tokenizer needs. Written to a staging folder and renamed
at the end: a failure leaves nothing at DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from engine.errors import ForgebenchError
from engine.fsutil import staged_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer_config.json")
SHARD_BYTES = 2 * 2**30

_LAYER = {   # GGUF layer tensor -> Hugging Face module (Llama, Qwen2, Qwen3)
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: one HF does not store, rope_freqs)."""
    stem, _, kind = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        table = _GEMMA3_LAYER if arch == "gemma3" else _LAYER
        if parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{kind}"
    return None


def _unpermute(x: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of llama.cpp's LlamaModel.permute."""
    return (x.reshape(n_heads, x.shape[0] // n_heads // 2, 2, *x.shape[1:])
            .swapaxes(1, 2).reshape(x.shape))


def hf_tensors(gguf_path: Path):
    """(HF name, f32 array) for every tensor of a dense GGUF, in file order."""
    from engine.gguf.convert import _to_f32
    from engine.gguf.writer import read_gguf_content

    content = read_gguf_content(gguf_path)
    meta = {k: v.python() for k, v in content.metadata.items()}
    arch = meta["general.architecture"]
    n_head = meta[f"{arch}.attention.head_count"]
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    for entry in content.tensors:
        name = hf_name(entry.name, arch)
        if name is None:
            continue
        x = _to_f32(entry)
        if arch == "llama" and ".attn_q." in entry.name:
            x = _unpermute(x, n_head)
        elif arch == "llama" and ".attn_k." in entry.name:
            x = _unpermute(x, n_kv)
        if arch == "gemma3" and entry.name.endswith("norm.weight"):
            x = x - np.float32(1.0)
        yield name, np.ascontiguousarray(x, dtype=np.float32)


def write_hf_folder(gguf_path: str | os.PathLike, hf_source: str | os.PathLike,
                    out: str | os.PathLike, *, card: str = "",
                    shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write the dense GGUF as an HF folder at `out` (must not exist), with the config and
    tokenizer of `hf_source` and the GGUF's chat template. Returns the files written."""
    from engine.gguf.writer import read_gguf_content
    from engine.hf.checkpoint import HFCheckpoint

    out, source = Path(out), Path(hf_source)
    if out.exists():
        raise ForgebenchError("the output folder already exists; an export never writes over "
                              "another", path=out, where="--out",
                              hint="choose a new --out or delete the old export")
    ckpt = HFCheckpoint.open(source)
    content = read_gguf_content(gguf_path)
    template = content.metadata.get("tokenizer.chat_template")
    template = template.python() if template is not None else None
    arch = content.metadata["general.architecture"].python()
    if arch != ckpt.arch:
        raise ForgebenchError(f"the model is {arch} but the HF source folder holds "
                              f"{ckpt.hf_arch}", path=source, where="--hf-source",
                              hint="give the base model's Hugging Face folder")
    with staged_dir(out) as staging:
        files, tied, vocab_rows = _write_weights(Path(gguf_path), staging, shard_bytes)
        files += _write_configs(ckpt, source, staging, tied, vocab_rows)
        files += _write_tokenizer(ckpt, source, staging, template, files)
        (staging / "README.md").write_text(card or f"# {out.name}\n")
        files.append("README.md")
    return files


def _write_weights(gguf_path: Path, staging: Path,
                   shard_bytes: int) -> tuple[list[str], bool, int | None]:
    """The tensors as safetensors shards of at most `shard_bytes` (with their index when
    there are several); the files, whether the embedding is tied (no lm_head), its rows."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    tied = True
    vocab_rows = None
    for name, x in hf_tensors(gguf_path):
        if name == "lm_head.weight":
            tied = False
        if name == "model.embed_tokens.weight":
            vocab_rows = x.shape[0]
        if sizes[-1] and sizes[-1] + x.nbytes > shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = x
        sizes[-1] += x.nbytes
    n = len(shards)
    files, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        fname = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, staging / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        files.append(fname)
    if n > 1:
        (staging / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2))
        files.append("model.safetensors.index.json")
    return files, tied, vocab_rows


def _write_configs(ckpt, source: Path, staging: Path, tied: bool,
                   vocab_rows: int | None) -> list[str]:
    """config.json (float32, the embedding's tying and rows) and generation_config.json."""
    config = dict(ckpt.config)
    config["torch_dtype"] = config["dtype"] = "float32"
    config["tie_word_embeddings"] = tied
    if vocab_rows is not None:
        if "text_config" in config:
            config["text_config"] = {**config["text_config"], "vocab_size": vocab_rows}
        else:
            config["vocab_size"] = vocab_rows
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config.get(k) is not None}
    if (source / "generation_config.json").is_file():
        generation = json.loads((source / "generation_config.json").read_text())
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return ["config.json", "generation_config.json"]


def _write_tokenizer(ckpt, source: Path, staging: Path, template: str | None,
                     written: list[str]) -> list[str]:
    """The source's tokenizer files, and the GGUF's chat template in tokenizer_config.json."""
    files = []
    for fname in TOKENIZER_FILES:
        if (source / fname).is_file():
            shutil.copyfile(source / fname, staging / fname)
            files.append(fname)
    if template:
        tok_config = ckpt.tokenizer_config | {"chat_template": template}
        (staging / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        (staging / "chat_template.jinja").unlink(missing_ok=True)
        if "tokenizer_config.json" not in written + files:
            files.append("tokenizer_config.json")
    return files


def library_hf_source(base_gguf: Path, base_sha256: str) -> Path | None:
    """The HF folder `forgebench models add DIR` converted the base from, if it did."""
    from engine import model_library

    root = base_gguf.parent.parent
    if base_gguf.parent.name != model_library.MODELS_DIR or \
            not (root / model_library.WORKSPACE_FILE).is_file():
        return None
    entry = model_library.find_by_sha256(root, base_sha256)
    if entry and entry.get("mode") == "hf" and Path(entry["source"]).is_dir():
        return Path(entry["source"])
    return None


def run_hf_source(run_dir: str | os.PathLike, hf_source: str | os.PathLike | None = None
                  ) -> Path:
    """The Hugging Face folder a merged export of the run takes its config and tokenizer from:
    `hf_source` (checked to be a checkpoint folder), else the one the run's base was converted
    from (the library's record). Raises the refusal the CLI and the export wizard show."""
    from engine.hf.checkpoint import HFCheckpoint
    from engine.rundir import RunDir

    run = RunDir(run_dir).require()
    if hf_source is not None:
        HFCheckpoint.open(hf_source)      # names the missing config/tokenizer/shard now
        return Path(hf_source)
    info = run.manifest().get("base_model") or {}
    found = library_hf_source(Path(info.get("path", "")), info.get("sha256", "")) \
        if info.get("path") else None
    if found is None:
        raise ForgebenchError(
            "the run's base did not come from a Hugging Face folder, so there is no "
            "tokenizer/config to ship", path=run.path, where="--format hf",
            hint="pass --hf-source DIR (the base model's Hugging Face folder), or start "
                 "runs from a base added with `forgebench models add DIR`")
    return found


def export_run_hf(run_dir: str | os.PathLike, out: str | os.PathLike, *,
                  checkpoint: str = "latest", base: str | None = None,
                  hf_source: str | None = None) -> list[str]:
    """`forgebench export RUN --format hf`: see the module docstring."""
    from engine.export.bundle import export_run
    from engine.rundir import RunDir

    out = Path(out).resolve()
    if out.exists():
        raise ForgebenchError("the output folder already exists; an export never writes over "
                              "another", path=out, where="--out",
                              hint="choose a new --out or delete the old export")
    run = RunDir(run_dir).require()
    hf_source = str(run_hf_source(run.path, hf_source))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.hf-", dir=out.parent) as scratch:
        bundle = export_run(run.path, Path(scratch) / "bundle", checkpoint=checkpoint,
                            dtype="f32", base=base, report=False)
        ggufs = [f for f in bundle.files if f.endswith(".gguf")]
        if not ggufs:
            raise ForgebenchError("the run exported no merged model", path=run.path,
                                  hint="merged HF exports need a dense (f32/f16/bf16) base")
        card_path = Path(scratch) / "bundle" / "model_card.md"
        card = card_path.read_text("utf-8") if card_path.is_file() else ""
        return write_hf_folder(Path(scratch) / "bundle" / ggufs[0], hf_source, out, card=card)
