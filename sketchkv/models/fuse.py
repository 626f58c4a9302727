"""Merge the projections that read the same input into one GEMM each (gpt-fast style: a transform
of the loaded model, not a flag threaded through it).

At decode time every projection is a memory-bound GEMV plus a launch; q/k/v, gate/up and the four
Gated DeltaNet input projections each become one. The original parameters stay (as views into the
fused weight), so names, checkpoints and fingerprints are unchanged and no memory is duplicated.

A fused weight is a tensor (bf16 linears), an Int4Weight (int4 linears, layers/int4_linear.py: the
canonical tensors concatenated along N) or, where a checkpoint mixes the two in one group (int4 GDN
q/k/v/z with bf16 gates b/a), a MixedWeight (int4 columns first: one launch of the W4A16 kernel at decode
sizes on the GPU, two GEMMs elsewhere) or a tuple (any other mix: a GEMM per part); `linear(x, w)` runs any of them.
"""
import torch
import torch.nn.functional as F
from torch import nn

from sketchkv.layers.int4_linear import Int4Linear
from sketchkv.ops.w4a16_gemm import Int4Weight, MixedWeight, mixed_in_one_launch, prepare_int4_weight, w4a16_matmul

FusedWeight = torch.Tensor | Int4Weight | MixedWeight | tuple

# int4 + bf16 runs of one fused projection as a MixedWeight (one launch at decode sizes); False: a tuple, a GEMM each.
# On: ~96 kernels fewer per 27B step (cuBLAS split-K + reduce per GDN layer), the same step time (H100 runs 128-129:
# GPU test passes; 8 x 250K 24.56 vs 24.62 ms off, 24.67 with COMPOSE_IN_TOPK too)
MIXED_ONE_LAUNCH = True


def linear(x: torch.Tensor, w: FusedWeight) -> torch.Tensor:
    """x @ W.T of a fused weight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if isinstance(w, (Int4Weight, MixedWeight)):
        return w4a16_matmul(x, w)
    return torch.cat([linear(x, part) for part in w], dim=-1)


def linear_split(x: torch.Tensor, w: FusedWeight, sizes: list[int]) -> list[torch.Tensor]:
    """linear(x, w).split(sizes, dim=-1), without the concatenation of a mixed weight: each GEMM's output is
    split on its own (one kernel less per layer and step; the sizes must not straddle two parts)."""
    if isinstance(w, MixedWeight) and not mixed_in_one_launch(x, w):
        w = (w.int4, w.dense)
    if not isinstance(w, tuple):
        return list(linear(x, w).split(sizes, dim=-1))
    out, i = [], 0
    for part in w:
        n, take = _out_features(part), []
        while n > 0:
            take.append(sizes[i])
            n, i = n - sizes[i], i + 1
        assert n == 0, "a split straddles two GEMMs of a mixed fused weight"
        out += linear_split(x, part, take)
    assert i == len(sizes)
    return out


def _out_features(w: FusedWeight) -> int:
    if isinstance(w, tuple):
        return sum(_out_features(part) for part in w)
    return w.out_features if isinstance(w, (Int4Weight, MixedWeight)) else w.shape[0]


def fuse_linears(linears: list[nn.Module]) -> FusedWeight | None:
    """Concatenate the weights (output features) of bias-free linears; re-point each at its slice.
    Consecutive linears of one kind fuse together (int4 ones when their group sizes agree)."""
    if any(lin.bias is not None for lin in linears):
        return None
    runs: list[list[nn.Module]] = []
    for lin in linears:
        if runs and _kind(runs[-1][0]) == _kind(lin):
            runs[-1].append(lin)
        else:
            runs.append([lin])
    fused = [_fuse_int4(run) if isinstance(run[0], Int4Linear) else _fuse_dense(run) for run in runs]
    if MIXED_ONE_LAUNCH and len(fused) == 2 and isinstance(fused[0], Int4Weight) and isinstance(fused[1], torch.Tensor):
        return MixedWeight(*fused)
    return fused[0] if len(fused) == 1 else tuple(fused)


def _kind(lin: nn.Module):
    return ("int4", lin.group_size, lin.scales.dtype) if isinstance(lin, Int4Linear) else "dense"


def _fuse_dense(linears: list[nn.Linear]) -> torch.Tensor:
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = fused[start:start + n]
        start += n
    return fused


def _fuse_int4(linears: list[Int4Linear]) -> Int4Weight:
    """Concatenate canonical tensors along N (before prepare_int4: the loader fuses first), prepare the result."""
    assert all(lin.int4 is None and not lin.fused for lin in linears), "int4 projections fuse before prepare_int4"
    cat = [torch.cat([getattr(lin, t).data for lin in linears], dim=1) for t in ("qweight", "scales", "zeros")]
    w = prepare_int4_weight(*cat, linears[0].group_size)
    start = 0
    for lin in linears:
        lin.adopt(w, slice(start, start + lin.out_features))
        lin.fused = True
        start += lin.out_features
    return w


def fuse_projections(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "fuse_projections"):
            m.fuse_projections()
