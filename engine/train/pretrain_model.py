"""An lm-pretrain run's model: the tiny Llama or nanochat GPT built from the run's config (its
`model.family`), and loaded back from a checkpoint with the tokenizer saved beside it.

It lives under the recipes so that both lm-pretrain and the fine-tuning recipes that start from
an lm-pretrain run (engine/train/lm_base.py) load it the same way without one recipe importing
another (docs/architecture.md).
"""

from __future__ import annotations

from engine.jobs import run_config
from engine.models.llama import Llama, LlamaConfig
from engine.models.nanochat import NanochatConfig, NanochatGPT
from engine.rundir import Checkpoint, RunDir
from engine.text_tokenizers import tokenizer_from_json
from engine.train.checkpoint import load_checkpoint
from engine.train.precision import torch_dtype

TOKENIZER_FILE = "tokenizer.json"


def nanochat_config(config, vocab_size: int) -> NanochatConfig:
    """nanochat's GPTConfig of an lm-pretrain config: from `model.depth` as base_train derives
    it, else from dim / n_layers / n_heads / n_kv_heads; the context is its sequence_len."""
    m = config.model
    if m.depth:
        return NanochatConfig.for_depth(m.depth, vocab_size=vocab_size,
                                        aspect_ratio=m.aspect_ratio, head_dim=m.head_dim,
                                        max_seq_len=m.context, window_pattern=m.window_pattern)
    return NanochatConfig(sequence_len=m.context, vocab_size=vocab_size, n_layer=m.n_layers,
                          n_head=m.n_heads, n_kv_head=m.n_kv_heads, n_embd=m.dim,
                          window_pattern=m.window_pattern)


def build_model(config, vocab_size: int, precision: str = "f32") -> Llama | NanochatGPT:
    """The decoder of an lm-pretrain config (its `model` section), with random weights. A
    nanochat model trained in bf16 (`precision`, the run's) is built in nanochat's own bf16
    scheme (embeddings stored in bf16; engine/models/nanochat.py); the Llama's bf16 is the
    recipe's autocast, whatever it is built with."""
    m = config.model
    if m.family == "nanochat":
        return NanochatGPT(nanochat_config(config, vocab_size), torch_dtype(precision))
    return Llama(LlamaConfig(vocab_size=vocab_size, dim=m.dim, n_layers=m.n_layers,
                             n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, ffn_dim=m.ffn_dim,
                             norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                             max_seq_len=m.context, tie_embeddings=m.tie_embeddings,
                             rope_type="norm"))


def load_model(run: RunDir, checkpoint: Checkpoint) -> tuple[Llama | NanochatGPT, object, object]:
    """(model in eval mode, tokenizer, config) from a committed checkpoint of an lm-pretrain
    run."""
    config = run_config(run)
    tokenizer = tokenizer_from_json((checkpoint.path / TOKENIZER_FILE).read_text("utf-8"),
                                    checkpoint.path / TOKENIZER_FILE)
    model = build_model(config, tokenizer.vocab_size)
    tensors, _, _ = load_checkpoint(checkpoint)
    model.load_state_dict(tensors)
    return model.eval(), tokenizer, config
