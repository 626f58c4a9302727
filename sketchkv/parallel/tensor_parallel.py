"""Tensor parallelism as a transform of a loaded model (gpt-fast style): `shard_model` cuts every
layer down to this rank's share in place, and the model code stays as it is.

- Attention: query heads (with their output gates) and KV heads split evenly; o_proj is
  row-parallel (partial outputs, one all-reduce). Sparse layers keep their KV heads' slice of the
  key basis; a shared pick per layer all-reduces the per-token scores first (comm.py).
- Gated DeltaNet: key heads and value heads split evenly, so value head h still reads key head
  h // (Hv / Hk) locally. in_proj_qkv and conv1d rows are [q | k | v]: each part is cut by its
  heads; z, b, a, dt_bias, A_log by value head; out_proj row-parallel.
- MLP: gate/up column-parallel, down row-parallel.
- Embedding: vocab rows split; a rank looks up the ids it owns, zeros for others, all-reduce.
  LM head: local vocab rows, logits all-gathered to the full vocab (tied weights stay tied).
- Int4 (W4A16) projections are cut the same way in their canonical tensors (the loader's packed words put back in
  natural order first): output columns of qweight / scales / zeros for column-parallel, whole quantization groups
  of input rows for row-parallel (so each rank's K share must be a multiple of the group size; a per-channel
  scale, one group over K, becomes one group over the rank's share).
Projections are fused again after the cut (models/fuse.py), so a rank runs one GEMM per group.

Known gap: every rank loads the full checkpoint on its device, then slices and frees the rest:
the peak is the whole model per device for a moment (54 GB for the 27B in bf16).
"""
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from sketchkv.errors import RequestError
from sketchkv.layers.gated_deltanet import GatedDeltaNet
from sketchkv.layers.int4_linear import Int4Linear, prepare_int4
from sketchkv.layers.mlp import MLP
from sketchkv.layers.sparse_attention import SparseAttention
from sketchkv.models.llama import LlamaAttention
from sketchkv.models.model_config import ModelConfig
from sketchkv.models.qwen3_5 import GatedAttention
from sketchkv.ops.w4a16_gemm import w4a16_matmul
from sketchkv.parallel.comm import all_reduce_sum, gather_last_dim


def check_supported(cfg, model_cfg: ModelConfig) -> None:
    """One-line RequestError for what tensor parallelism does not handle (yet), before any process starts."""
    n = cfg.tensor_parallel_size
    if n < 1:
        raise RequestError(f"tensor_parallel_size must be >= 1, got {n}")
    if model_cfg.family == "qwen4_exp":
        raise RequestError("tensor parallelism does not support qwen4_exp models yet (QSA indexer, hyper-connections)")
    if model_cfg.num_experts:
        raise RequestError("tensor parallelism does not support MoE models yet (experts are not sharded)")
    if cfg.sparse.host_tier:
        raise RequestError("tensor parallelism with sparse_host_tier is not supported yet")
    if cfg.num_speculative_tokens:
        raise RequestError("tensor parallelism with speculative decoding (num_speculative_tokens > 0) is not supported yet")
    sizes = {"num_attention_heads": model_cfg.num_heads, "num_key_value_heads": model_cfg.num_kv_heads,
             "intermediate_size": model_cfg.intermediate_size, "vocab_size": model_cfg.vocab_size}
    if model_cfg.linear_attention_layers:
        sizes.update(linear_num_key_heads=model_cfg.linear_num_key_heads,
                     linear_num_value_heads=model_cfg.linear_num_value_heads)
    bad = [f"{k}={v}" for k, v in sizes.items() if v % n]
    if bad:
        raise RequestError(f"tensor_parallel_size={n} must divide the model's {', '.join(bad)}")
    group = (model_cfg.quantization_config or {}).get("group_size", 0)
    if group and group > 0:   # row-parallel int4 projections take whole groups of input rows
        shares = {"o_proj": model_cfg.num_heads * model_cfg.head_dim // n, "down_proj": model_cfg.intermediate_size // n}
        if model_cfg.linear_attention_layers:
            shares["out_proj"] = model_cfg.linear_num_value_heads * model_cfg.linear_value_head_dim // n
        bad = [f"{k} {v}" for k, v in shares.items() if v % group]
        if bad:
            raise RequestError(f"tensor_parallel_size={n} leaves each rank input rows that are not whole int4 groups of "
                               f"{group} ({', '.join(bad)}): use a smaller tensor_parallel_size or group size")


def shard_model(model: nn.Module, model_cfg: ModelConfig, rank: int, world: int) -> ModelConfig:
    """Keep rank's share of every layer (in place). -> the per-rank ModelConfig (heads and widths of
    one shard; vocab_size stays full since logits are gathered), which sizes the KV cache."""
    with torch.no_grad():
        for m in list(model.modules()):
            if isinstance(m, (GatedAttention, LlamaAttention)):
                cut = _shard_attention
            elif isinstance(m, GatedDeltaNet):
                cut = _shard_gated_deltanet
            elif isinstance(m, MLP):
                cut = _shard_mlp
            else:
                continue
            # one module at a time: its int4 linears' canonical copies live only until its shares exist
            for lin in m.modules():
                if isinstance(lin, Int4Linear):
                    lin.unprepare()
            cut(m, rank, world)
            m.fuse_projections()
        _shard_vocab(model, rank, world)
        prepare_int4(model)   # the int4 projections no group fused
    n = world
    return dataclasses.replace(model_cfg, num_heads=model_cfg.num_heads // n, num_kv_heads=model_cfg.num_kv_heads // n,
                               intermediate_size=model_cfg.intermediate_size // n,
                               linear_num_key_heads=model_cfg.linear_num_key_heads // n,
                               linear_num_value_heads=model_cfg.linear_num_value_heads // n)


class RowParallelLinear(nn.Linear):
    """Input features split across ranks: each computes a partial product; the all-reduce adds them
    up, then the bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_sum(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class RowParallelInt4Linear(Int4Linear):
    """RowParallelLinear with int4 weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_sum(w4a16_matmul(x, self.int4))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding table; ids outside them look up zeros."""

    def __init__(self, weight: nn.Parameter, start: int):
        super().__init__()
        self.weight, self.start = weight, start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce_sum(out.masked_fill_(~mine[:, None], 0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocab rows, all-gathered to the full vocabulary (every rank gets them)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(F.linear(hidden, self.weight))


# ---- the cuts ------------------------------------------------------------------------------------
def _share(rank: int, world: int, n: int) -> range:
    k = n // world
    return range(rank * k, (rank + 1) * k)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)  # a copy: the full tensor can be freed


def _keep_rows(lin: nn.Module, ranges: list[range]) -> None:
    """Column-parallel: keep the output rows (features) in `ranges` (an int4 linear: those columns of its tensors)."""
    if isinstance(lin, Int4Linear):
        for t in ("qweight", "scales", "zeros"):
            setattr(lin, t, _param(torch.cat([getattr(lin, t)[:, r.start:r.stop] for r in ranges], dim=1)))
        lin.out_features = lin.qweight.shape[1]
    else:
        lin.weight = _param(torch.cat([lin.weight[r.start:r.stop] for r in ranges]))
        lin.out_features = lin.weight.shape[0]
    if lin.bias is not None:
        lin.bias = _param(torch.cat([lin.bias[r.start:r.stop] for r in ranges]))


def _row_parallel(lin: nn.Module, cols: range) -> nn.Module:
    if isinstance(lin, Int4Linear):
        G = lin.group_size
        g = len(cols) if G == lin.in_features else G    # a per-channel scale: one group over the share
        assert cols.start % g == 0 and len(cols) % g == 0, (cols, G)   # check_supported refused it otherwise
        out = RowParallelInt4Linear(len(cols), lin.out_features, g, bias=lin.bias is not None,
                                    dtype=lin.scales.dtype, device="meta")
        out.qweight = _param(lin.qweight[cols.start // 8:cols.stop // 8])
        groups = slice(0, 1) if g != G else slice(cols.start // G, cols.stop // G)
        out.scales, out.zeros = _param(lin.scales[groups]), _param(lin.zeros[groups])
    else:
        out = RowParallelLinear(len(cols), lin.out_features, bias=lin.bias is not None, device="meta")
        out.weight = _param(lin.weight[:, cols.start:cols.stop])
    if lin.bias is not None:
        out.bias = _param(lin.bias)
    return out


def _scaled(r: range, k: int, offset: int = 0) -> range:
    """Head range -> row range (k rows per head)."""
    return range(offset + r.start * k, offset + r.stop * k)


def _shard_attention(m: nn.Module, rank: int, world: int) -> None:
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    heads, kv = _share(rank, world, H), _share(rank, world, Hkv)
    m.qkv = None  # fused view of the full weights; fused again after the cut
    _keep_rows(m.q_proj, [_scaled(heads, m.q_proj.out_features // H)])  # D per head, or [q; gate] 2D (hybrids)
    _keep_rows(m.k_proj, [_scaled(kv, D)])
    _keep_rows(m.v_proj, [_scaled(kv, D)])
    m.o_proj = _row_parallel(m.o_proj, _scaled(heads, D))
    m.num_heads, m.num_kv_heads = len(heads), len(kv)
    core = m.attn
    core.num_heads, core.num_kv_heads = len(heads), len(kv)
    if isinstance(core, SparseAttention):  # installed before the cut: slice its basis to our KV heads
        core.basis = core.basis[kv.start:kv.stop].contiguous()
        core.mean = core.mean[kv.start:kv.stop].contiguous()
        core.tensor_parallel = True


def _shard_gated_deltanet(m: GatedDeltaNet, rank: int, world: int) -> None:
    kh, vh = _share(rank, world, m.num_k_heads), _share(rank, world, m.num_v_heads)
    dk, dv, key_dim = m.head_k_dim, m.head_v_dim, m.key_dim
    qkv = [_scaled(kh, dk), _scaled(kh, dk, key_dim), _scaled(vh, dv, 2 * key_dim)]  # rows: [q | k | v]
    m.in_proj = None
    _keep_rows(m.in_proj_qkv, qkv)
    m.conv1d.weight = _param(torch.cat([m.conv1d.weight[r.start:r.stop] for r in qkv]))
    _keep_rows(m.in_proj_z, [_scaled(vh, dv)])
    _keep_rows(m.in_proj_b, [vh])
    _keep_rows(m.in_proj_a, [vh])
    m.dt_bias = _param(m.dt_bias[vh.start:vh.stop])
    m.A_log = _param(m.A_log[vh.start:vh.stop])
    m.out_proj = _row_parallel(m.out_proj, _scaled(vh, dv))
    m.num_k_heads, m.num_v_heads = len(kh), len(vh)
    m.key_dim, m.value_dim = len(kh) * dk, len(vh) * dv
    m.conv_dim = 2 * m.key_dim + m.value_dim


def _shard_mlp(m: MLP, rank: int, world: int) -> None:
    cols = _share(rank, world, m.gate_proj.out_features)
    m.gate_up = None
    _keep_rows(m.gate_proj, [cols])
    _keep_rows(m.up_proj, [cols])
    m.down_proj = _row_parallel(m.down_proj, cols)


def _shard_vocab(model: nn.Module, rank: int, world: int) -> None:
    emb, head = model.model.embed_tokens, model.lm_head
    tied = head.weight is emb.weight
    rows = _share(rank, world, emb.weight.shape[0])
    weight = _param(emb.weight[rows.start:rows.stop])
    model.model.embed_tokens = VocabParallelEmbedding(weight, rows.start)
    model.lm_head = ParallelLMHead(weight if tied else _param(head.weight[rows.start:rows.stop]))
