"""Per-Layer n-gram Embeddings (qwen4_exp PLE), as transformers' Qwen4ExpTextPLELayer computes them.

For every token, the 2..ngram_size-grams ending at it (context reset after an EOS) are hashed by
`heads_per_ngram` multiply-xor hashes into prime-sized tables (one concatenated embedding); the
concatenated embedding gives a value and one key per residual stream, the normed stream gates
the value, and a dilated causal depthwise convolution (kernel K, dilation ngram_size) adds local
context. The output is added to every hyper-connection stream before the layer.

Per-sequence state (one slot per sequence, like Gated DeltaNet): the last ngram_size - 1 token ids
(EOS before the start) and the convolution's last (K - 1) * dilation inputs (zeros at the start).
"""
import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from sketchkv.engine.context import get_context
from sketchkv.layers.hyper_connection import GroupRMSNorm

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME_1 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def layer_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    half = max(1, (((1 << 63) - 1) // max(vocab, 1)) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(v: int) -> bool:
    if v < 2 or v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


@lru_cache(maxsize=8)
def primes_after(base: int, count: int) -> tuple[int, ...]:
    """The first `count` primes > base - 1 (head h of PLE layer i uses entry i * heads + h)."""
    out, p = [], base - 1
    while len(out) < count:
        p += 1
        while not _is_prime(p):
            p += 1
        out.append(p)
    return tuple(out)


class NGramEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, ngram_size: int, heads_per_ngram: int, ple_index: int,
                 vocab_base: int, divisor: int, seed: int, eos: int):
        super().__init__()
        self.ngram_size, self.heads_per_ngram, self.eos = ngram_size, heads_per_ngram, eos
        heads = (ngram_size - 1) * heads_per_ngram
        sizes = list(primes_after(vocab_base, (ple_index + 1) * heads)[ple_index * heads:])
        offsets = [sum(sizes[:i]) for i in range(heads)]
        rows = math.ceil(sum(sizes) / divisor) * divisor
        self.register_buffer("layer_multipliers", torch.tensor(layer_multipliers(vocab, ngram_size, ple_index, seed)))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long))
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long))
        self.ngram_embedding = nn.Embedding(rows, dim // heads)

    def _shift(self, ids: torch.Tensor, shift: int) -> torch.Tensor:
        """transformers' _shift_right_ignore_eos: token `shift` back, EOS across a document boundary."""
        if shift == 0:
            return ids
        B, L = ids.shape
        pos = torch.arange(L, device=ids.device)
        eos_pos = torch.where(ids == self.eos, pos, -1)
        prev = torch.cat([eos_pos.new_full((B, 1), -1), torch.cummax(eos_pos, dim=1).values[:, :-1]], dim=1)
        in_segment = pos[None] - (prev + 1)
        src = pos - shift
        shifted = ids.gather(1, src.clamp_min(0)[None].expand(B, -1))
        valid = (in_segment >= shift) & (src[None] >= 0)
        return torch.where(valid, shifted, ids.new_full((), self.eos))

    def forward(self, history: torch.Tensor, n: int) -> torch.Tensor:
        """history [B, C + n] token ids (C = ngram_size - 1 tokens of context) -> [B, n, dim]."""
        shifted = [self._shift(history, s) for s in range(self.ngram_size)]
        m = self.layer_multipliers
        blocks = []
        for ngram in range(2, self.ngram_size + 1):
            lo, hi = (ngram - 2) * self.heads_per_ngram, (ngram - 1) * self.heads_per_ngram
            mixed = shifted[0] * m[0]
            for p in range(1, ngram):
                mixed = torch.bitwise_xor(mixed, shifted[p] * m[p])
            ids = torch.remainder(mixed[..., None], self.ngram_heads_vocab_sizes[lo:hi].view(1, 1, -1))
            blocks.append(ids + self.ngram_heads_offsets[lo:hi].view(1, 1, -1))
        ids = torch.cat(blocks, dim=-1)[:, -n:]
        return self.ngram_embedding(ids).flatten(-2)


class PerLayerEmbedding(nn.Module):
    def __init__(self, cfg, ple_index: int):
        super().__init__()
        H, hc = cfg.hidden_size, cfg.hc_count
        self.hidden, self.hc, self.eps = H, hc, cfg.rms_norm_eps
        self.context = cfg.ngram_size - 1
        self.eos = cfg.eos_token_ids[0]
        self.ple_embedding = NGramEmbedding(cfg.vocab_size, cfg.ple_embed_dim, cfg.ngram_size, cfg.heads_per_ngram,
                                            ple_index, cfg.ngram_vocab_size_base, cfg.ngram_vocab_divisor,
                                            cfg.ngram_seed, self.eos)
        self.key_proj = nn.Linear(cfg.ple_embed_dim, hc * H, bias=False)
        self.value_proj = nn.Linear(cfg.ple_embed_dim, H, bias=False)
        self.norm_key = GroupRMSNorm(hc * H, H, cfg.rms_norm_eps)
        self.norm_query = GroupRMSNorm(hc * H, H, cfg.rms_norm_eps)
        self.norm_conv = GroupRMSNorm(hc * H, H, cfg.rms_norm_eps)
        self.kernel, self.dilation = cfg.ple_conv_kernel_size, cfg.ngram_size
        self.conv_len = (self.kernel - 1) * self.dilation
        self.conv1d = nn.Module()  # checkpoint name conv1d.weight [hc*H, 1, K]
        self.conv1d.weight = nn.Parameter(torch.empty(hc * H, 1, self.kernel))
        # Bound by the model runner: one row per sequence slot
        self.ids_state = torch.tensor([])   # [slots, ngram_size - 1] int64
        self.conv_state = torch.tensor([])  # [slots, conv_len, hc*H]

    # ---- per-sequence state (the model runner allocates, resets and snapshots it) ---------------
    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.ids_state = torch.full((num_slots, self.context), self.eos, dtype=torch.long, device=device)
        self.conv_state = torch.zeros(num_slots, self.conv_len, self.hc * self.hidden, dtype=dtype, device=device)

    def reset_state(self, slots: torch.Tensor) -> None:
        self.ids_state.index_fill_(0, slots, self.eos)
        self.conv_state.index_fill_(0, slots, 0)

    def slot_state(self, slot: int) -> list[torch.Tensor]:
        return [self.ids_state[slot], self.conv_state[slot]]

    def state_bytes(self, dtype: torch.dtype) -> int:
        return self.context * 8 + self.conv_len * self.hc * self.hidden * dtype.itemsize

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hc*H] streams, input_ids [T] -> the PLE term [T, hc*H] added to every stream."""
        ctx = get_context()
        T = x.shape[0]
        emb = torch.empty(T, self.key_proj.in_features, dtype=x.dtype, device=x.device)
        if ctx.is_decode:
            hist = torch.cat([self.ids_state[ctx.state_slots], input_ids[:, None]], dim=1)
            emb = self.ple_embedding(hist, 1)[:, 0]
            self.ids_state[ctx.state_slots] = hist[:, 1:]
        else:
            end = 0
            for b, n in enumerate(ctx.query_lens):
                start, end = end, end + n
                slot = ctx.state_slots[b]
                hist = torch.cat([self.ids_state[slot], input_ids[start:end]])[None]
                emb[start:end] = self.ple_embedding(hist, n)[0].to(x.dtype)
                self.ids_state[slot] = hist[0, -self.context:]
        emb = emb.to(x.dtype)
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(emb)
        query = self.norm_query(x).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * value.unsqueeze(-2)
        normed = self.norm_conv(gated.flatten(-2))
        return gated.flatten(-2) + self._short_conv(normed, ctx)

    def _short_conv(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """silu(dilated causal depthwise conv) over [state; x] per sequence; the state keeps the last inputs."""
        w = self.conv1d.weight  # [C, 1, K]
        if ctx.is_decode:
            xs = torch.cat([self.conv_state[ctx.state_slots], x[:, None]], dim=1)  # [B, conv_len + 1, C]
            taps = xs[:, :: self.dilation]                                         # [B, K, C]
            y = (taps * w[:, 0].T[None]).sum(dim=1)
            self.conv_state[ctx.state_slots] = xs[:, 1:]
            return F.silu(y)
        out = torch.empty_like(x)
        end = 0
        for b, n in enumerate(ctx.query_lens):
            start, end = end, end + n
            slot = ctx.state_slots[b]
            xs = torch.cat([self.conv_state[slot], x[start:end]])                   # [conv_len + n, C]
            y = F.conv1d(xs.T[None], w, groups=w.shape[0], dilation=self.dilation)  # [1, C, n]
            out[start:end] = F.silu(y[0].T)
            self.conv_state[slot] = xs[-self.conv_len:]
        return out
