"""Tiny Hugging Face checkpoint folders built offline, and llama.cpp's converter as the oracle.

`make_checkpoint(family, folder)` writes a random model of the family with `transformers`
(from a config, no download) and a SentencePiece tokenizer trained here with the
`sentencepiece` package, plus tokenizer_config.json with a chat template: the kind of folder
llama.cpp's `convert_hf_to_gguf.py` accepts offline. `llama_convert` runs that converter (the
copy `make verify-extra` extracts from the llama-cpp-python sdist into
.venv/share/llama.cpp-convert, or FORGEBENCH_LLAMA_CONVERTER) in a subprocess.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHAT_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                 "{% endif %}")
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
VOCAB = 320


def converter_path() -> Path | None:
    env = os.environ.get("FORGEBENCH_LLAMA_CONVERTER")
    candidates = [Path(env)] if env else []
    candidates.append(Path(sys.prefix) / "share" / "llama.cpp-convert" / "convert_hf_to_gguf.py")
    return next((p for p in candidates if p.is_file()), None)


def require_converter() -> Path:
    path = converter_path()
    if path is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not extracted (run `make verify-extra`"
                    " or set FORGEBENCH_LLAMA_CONVERTER)")
    pytest.importorskip("transformers", reason="the converter needs transformers (parity extra)")
    pytest.importorskip("sentencepiece")
    return path


def llama_convert(folder: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's converter on `folder` (f32/f16/bf16/q8_0), offline, in a subprocess."""
    script = require_converter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(script), str(folder), "--outtype", outtype,
                           "--outfile", str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _train_spm(vocab: int) -> bytes:
    import sentencepiece as spm

    words = ("the a model trains on data and learns small weights fast slow rope norm head "
             "token vocab layer attention query key value cat dog runs jumps over lazy quick "
             "brown fox hello world forge bench gguf convert shard stream").split()
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab - 2,
        model_type="unigram", byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        user_defined_symbols=[], hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return model.getvalue()


_SPM_CACHE: dict[int, bytes] = {}


def _config(family: str, hidden: int, layers: int, vocab: int):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return tf.LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                              architectures=["LlamaForCausalLM"]), tf.LlamaForCausalLM
    if family == "mistral":
        return tf.MistralConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                sliding_window=None, head_dim=hidden // 4,
                                architectures=["MistralForCausalLM"]), tf.MistralForCausalLM
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True,
                              architectures=["Qwen2ForCausalLM"]), tf.Qwen2ForCausalLM
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=hidden // 4, tie_word_embeddings=True,
                              architectures=["Qwen3ForCausalLM"]), tf.Qwen3ForCausalLM
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=hidden // 4, sliding_window=64,
                                   query_pre_attn_scalar=hidden // 4,
                                   architectures=["Gemma3ForCausalLM"]), tf.Gemma3ForCausalLM
    raise ValueError(family)


def make_checkpoint(family: str, folder: Path, *, hidden: int = 256, layers: int = 2,
                    dtype: str = "bfloat16", seed: int = 0, max_shard_size: str | None = None,
                    vocab: int = VOCAB) -> Path:
    """A random `family` model in `folder` (see the module docstring)."""
    import torch

    config, model_cls = _config(family, hidden, layers, vocab)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():     # norms away from their init so a missed shift shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family == "gemma3" else 1.0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if vocab not in _SPM_CACHE:
        _SPM_CACHE[vocab] = _train_spm(vocab)
    (folder / "tokenizer.model").write_bytes(_SPM_CACHE[vocab])
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(vocab - 2): {"content": "<start_of_turn>", "special": True},
            str(vocab - 1): {"content": "<end_of_turn>", "special": True}},
    }))
    return folder


def spm_model(vocab: int = VOCAB) -> bytes:
    if vocab not in _SPM_CACHE:
        _SPM_CACHE[vocab] = _train_spm(vocab)
    return _SPM_CACHE[vocab]


def make_raw_llama(folder: Path, *, hidden: int = 128, ffn: int = 256, layers: int = 2,
                   vocab: int = VOCAB, heads: int = 4, kv_heads: int = 2, shards: int = 1,
                   seed: int = 0) -> Path:
    """A Llama checkpoint folder written without transformers (config.json by hand, bf16
    safetensors from torch, a SentencePiece tokenizer), optionally sharded with an index:
    the default suite's input, which needs no oracle."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": (1 + rand(hidden)).to(torch.bfloat16),
               "lm_head.weight": rand(vocab, hidden)}
    head_dim = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": (1 + rand(hidden)).to(torch.bfloat16),
            p + "post_attention_layernorm.weight": (1 + rand(hidden)).to(torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(ffn, hidden),
            p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
    else:
        weight_map = {}
        for k in range(shards):
            shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, folder / shard)
            weight_map.update({n: shard for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "tokenizer.model").write_bytes(spm_model(vocab))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE}))
    return folder


def write_bpe_tokenizer(folder: Path, vocab: int = VOCAB) -> str:
    """A byte-level BPE tokenizer.json (Qwen-style special tokens) trained here with the
    `tokenizers` package, in place of the folder's SentencePiece model; returns the SHA-256
    llama.cpp's get_vocab_base_pre computes for it (no released model has it, so the oracle is
    told to take it as "qwen2")."""
    import random
    from hashlib import sha256

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from engine.hf.tokenizer import CHECK_TEXT

    rng = random.Random(1)
    words = "the a model trains on data and learns small weights fast slow rope norm".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    tok.add_special_tokens(special)
    (folder / "tokenizer.model").unlink(missing_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False,
                                          "lstrip": False, "rstrip": False,
                                          "single_word": False}
                                 for t, i in ids.items()}}))
    return sha256(str(tok.encode(CHECK_TEXT).ids).encode()).hexdigest()


def llama_convert_as_known_pre(folder: Path, out: Path, outtype: str, pre: str) -> Path:
    """llama.cpp's converter with get_vocab_base_pre answering `pre` (for a tokenizer trained in
    the test, whose hash no released model has)."""
    script = require_converter()
    wrapper = out.with_suffix(".run.py")
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(script.parent)!r}, {str(script.parent / 'gguf-py')!r}]\n"
        "import conversion.base as base\n"
        f"base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}\n"
        f"sys.argv = [{str(script)!r}, {str(folder)!r}, '--outtype', {outtype!r}, "
        f"'--outfile', {str(out)!r}]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(wrapper)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
