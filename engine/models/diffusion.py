"""Class-conditional denoising U-Nets: 2-D for 32×32 images, 1-D for 8192-sample waveforms.

One network definition serves both (`dims` picks Conv1d or Conv2d). Each level is a residual
block whose features are shifted by an embedding of (timestep, class); the class table has one
extra row, the learned null class used for classifier-free guidance. Output: predicted noise ε
with the input's shape.

`attention` (off by default, so existing configs and checkpoints build the same network) adds
multi-head self-attention over the positions of the lowest resolution, after its down block and
after the middle block. A 3×3 convolution combines neighbours only, so whether a square's edge
runs parallel to the opposite one must be carried through the stack of levels; attention compares
every position with every other in one step (8×8 = 64 positions for a 32×32 image: cheap beside
the full-resolution convolutions, about 7% more training time).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class UNetConfig:
    dims: int                      # 1 = waveform [B, C, L], 2 = image [B, C, H, W]
    in_channels: int               # 3 for RGB, 1 for mono audio
    channels: tuple[int, ...]      # feature channels per level (len - 1 downsamplings)
    factor: int                    # down/upsampling factor between levels
    kernel: int                    # convolution kernel size
    num_classes: int               # real classes; index num_classes is the null class
    emb_dim: int = 64
    attention: bool = False        # self-attention at the lowest resolution (see module doc)

    def to_dict(self) -> dict:
        return asdict(self)


# Defaults sized for minutes of CPU training: 32 -> 16 -> 8 pixels (width 32 at full resolution:
# 16 gave shapeless blobs); 8192 -> 2048 -> 512 -> 128 samples.
IMAGE_32 = dict(dims=2, in_channels=3, channels=(32, 64, 128), factor=2, kernel=3)
AUDIO_8192 = dict(dims=1, in_channels=1, channels=(16, 32, 64, 64), factor=4, kernel=5)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps [B] -> [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, conv: type, c_in: int, c_out: int, kernel: int, emb_dim: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(min(8, c_in), c_in)
        self.conv1 = conv(c_in, c_out, kernel, padding=kernel // 2)
        self.emb = nn.Linear(emb_dim, c_out)
        self.norm2 = nn.GroupNorm(min(8, c_out), c_out)
        self.conv2 = conv(c_out, c_out, kernel, padding=kernel // 2)
        self.skip = conv(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))                 # [B, c_out, *S]
        h = h + self.emb(emb).view(*emb.shape[:1], -1, *([1] * (x.dim() - 2)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class SelfAttention(nn.Module):
    """Pre-norm multi-head self-attention over the positions of [B, C, *S], added back to the
    input; its output projection starts at zero, so the block starts as the identity."""

    def __init__(self, channels: int, heads: int = 4):
        super().__init__()
        self.norm = nn.GroupNorm(min(8, channels), channels)
        self.attn = nn.MultiheadAttention(channels, heads, batch_first=True)
        nn.init.zeros_(self.attn.out_proj.weight)
        nn.init.zeros_(self.attn.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(x).flatten(2).transpose(1, 2)      # [B, positions, C]
        out, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        return x + out.transpose(1, 2).reshape(x.shape)


class DenoisingUNet(nn.Module):
    """ε-prediction U-Net: levels down by `factor`, a middle block, levels up with skips."""

    def __init__(self, config: UNetConfig):
        super().__init__()
        self.config = config
        conv = nn.Conv1d if config.dims == 1 else nn.Conv2d
        c, k, f, e = config.channels, config.kernel, config.factor, config.emb_dim
        self.time_mlp = nn.Sequential(nn.Linear(e, e), nn.SiLU(), nn.Linear(e, e))
        self.class_emb = nn.Embedding(config.num_classes + 1, e)
        self.stem = conv(config.in_channels, c[0], k, padding=k // 2)
        self.down_blocks = nn.ModuleList(ResBlock(conv, c[i], c[i], k, e) for i in range(len(c)))
        self.downsample = nn.ModuleList(conv(c[i], c[i + 1], f, stride=f)
                                        for i in range(len(c) - 1))
        self.middle = ResBlock(conv, c[-1], c[-1], k, e)
        if config.attention:
            self.low_attention = SelfAttention(c[-1])
            self.middle_attention = SelfAttention(c[-1])
        self.upsample = nn.ModuleList(conv(c[i + 1], c[i], k, padding=k // 2)
                                      for i in range(len(c) - 1))
        self.up_blocks = nn.ModuleList(ResBlock(conv, 2 * c[i], c[i], k, e)
                                       for i in range(len(c) - 1))
        self.head = nn.Sequential(nn.GroupNorm(min(8, c[0]), c[0]), nn.SiLU(),
                                  conv(c[0], config.in_channels, k, padding=k // 2))
        nn.init.zeros_(self.head[-1].weight)   # start as "predict no noise": a stable first step
        nn.init.zeros_(self.head[-1].bias)

    @property
    def null_label(self) -> int:
        return self.config.num_classes

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        emb = self.time_mlp(timestep_embedding(t, self.config.emb_dim)) + self.class_emb(labels)
        h = self.stem(x)                                      # [B, c0, *S]
        skips = []
        for level, block in enumerate(self.down_blocks):
            h = block(h, emb)
            if self.config.attention and level == len(self.downsample):
                h = self.low_attention(h)
            if level < len(self.downsample):
                skips.append(h)
                h = self.downsample[level](h)                 # [B, c_{l+1}, *S / f^(l+1)]
        h = self.middle(h, emb)
        if self.config.attention:
            h = self.middle_attention(h)
        for level in reversed(range(len(self.up_blocks))):
            h = F.interpolate(h, size=skips[level].shape[2:], mode="nearest")
            h = self.upsample[level](h)                       # [B, c_l, *S / f^l]
            h = self.up_blocks[level](torch.cat([h, skips[level]], dim=1), emb)
        return self.head(h)                                   # [B, in_channels, *S]
