"""Rotary position embedding (neox layout: rotate halves), partial rotary, Llama-3 frequency scaling."""
import math

import torch
from torch import nn

from sketchkv.engine.context import current_context
from sketchkv.ops.rotary import apply_rotary


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
        self.key = ("rotary", rotary_dim, base, repr(sorted((rope_scaling or {}).items())))   # forward-cache key

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos / sin [T, rotary_dim] of the positions (transformers' arithmetic). Computed by the first
        layer of a forward and reused by the others with the same rotary config (kept in the forward
        context with the positions tensor they belong to)."""
        ctx = current_context()
        hit = ctx.cache.get(self.key) if ctx is not None else None
        if hit is not None and hit[0] is positions:
            return hit[1], hit[2]
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if ctx is not None:
            ctx.cache[self.key] = (positions, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D]; rotates the first rotary_dim dims of each head (new tensors)."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, k, cos, sin, self.rotary_dim)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One tensor x [T, H, Dx] (Dx >= rotary_dim): the first rotary_dim dims of each head rotated."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, None, cos, sin, self.rotary_dim)[0]
