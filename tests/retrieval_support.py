"""A tiny random BERT sentence encoder written as a sentence-transformers folder, so the default
suite exercises the embed-retrieval code without the real MiniLM package."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def words_of(texts) -> list[str]:
    return sorted({w for t in texts for w in re.findall(r"[a-z0-9]+|[^a-z0-9\s]", t.lower())})


def write_tiny_bert(folder: Path, texts, *, hidden: int = 32, layers: int = 2, heads: int = 4,
                    seed: int = 0, pooling: str = "mean") -> Path:
    """config.json, model.safetensors (random weights), tokenizer.json (WordPiece over the
    words of `texts`) and the pooling config; returns the folder."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    from engine.models.bert import Bert, BertConfig

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIALS + words_of(texts))}
    tokenizer = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    (folder / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {"vocab_size": len(vocab), "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "intermediate_size": 4 * hidden,
              "max_position_embeddings": 64, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
              "hidden_act": "gelu", "model_type": "bert"}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    torch.manual_seed(seed)
    model = Bert(BertConfig.from_json(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.normal_(0, 0.2)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": pooling == "mean",
         "pooling_mode_cls_token": pooling == "cls"}), encoding="utf-8")
    return folder
