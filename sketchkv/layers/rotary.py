"""Rotary position embedding (neox layout: rotate halves), partial rotary, Llama-3 frequency scaling."""
import math

import torch
from torch import nn


def _llama3_scale(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor = rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, rope_scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D]; rotates the first rotary_dim dims of each head."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One tensor x [T, H, Dx] (Dx >= rotary_dim): the first rotary_dim dims of each head rotated."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return _apply(x, emb.cos()[:, None, :], emb.sin()[:, None, :], self.rotary_dim)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    # Same op order and dtype as transformers: cos/sin cast to the activation dtype first.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if rd < x.shape[-1] else out
