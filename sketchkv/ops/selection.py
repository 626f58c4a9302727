"""The rows one sparse decode step attends: sinks, picks and the recent window, ascending and compacted.

For each row b (and selection head h) with context n = seq_lens[b]:
  sinks   positions 0 .. min(n, S) - 1
  picks   picks[b, h] (ascending, SENTINEL-padded: the top-k positions among the candidates in
          [S, n_lead - R), so all above the sinks and below the recent window)
  recent  positions max(n_lead - R, S) .. n - 1, at most R + extra of them (n_lead = n, extra = 0 except
          in a verification step with one selection per sequence: its first row's length, and the drafts)
-> idx [B, H, S + k + R + extra] int32, valid entries first (ascending), SENTINEL after; counts [B] (head 0).
The three groups are disjoint and already ordered, so compaction is all that is left: the reference
concatenates and sorts, the Triton kernel writes each group at its offset (one launch instead of ~12
small kernels and a segmented sort per layer and step). `select_top_k` goes one launch further for a plain
decode step (n_lead = n, extra = 0): top-k's compaction kernel writes these rows itself (topk_positions'
compose), so no picks tensor and no compose kernel.
"""
import os

import torch

from sketchkv.ops.topk import topk_positions, topk_positions_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SENTINEL = torch.iinfo(torch.int32).max
# select_top_k composes inside top-k's compaction (Triton); False: topk_positions, then compose_selection.
# On: 32 launches fewer per 8 x 250K step, the same step time (H100 runs 128-129: GPU test passes; 24.37 / 24.83 vs
# 24.62 / 24.69 ms off, two pairs)
COMPOSE_IN_TOPK = True


def compose_selection_ref(picks, seq_lens, n_lead, sinks: int, recent: int, extra: int = 0):
    """picks [B, H, k] int32; seq_lens, n_lead [B] -> (idx [B, H, S + k + R + extra] int32, counts [B] int32)."""
    B, H, _ = picks.shape
    dev = picks.device
    n, lead = seq_lens.long()[:, None, None], n_lead.long()[:, None, None]
    ar_s = torch.arange(sinks, device=dev)
    ar_r = torch.arange(recent + extra, device=dev)
    sink = torch.where(ar_s < n, ar_s, SENTINEL)
    start = torch.maximum(lead - recent, torch.full_like(lead, sinks))
    tail = torch.where(start + ar_r < n, start + ar_r, SENTINEL)
    idx = torch.cat([sink.expand(B, H, -1).int(), picks.int(), tail.expand(B, H, -1).int()], dim=-1)
    idx = torch.sort(idx, dim=-1).values
    return idx.to(torch.int32), (idx[:, 0] < SENTINEL).sum(-1).to(torch.int32)


if triton is not None:

    @triton.jit
    def _compose_selection_kernel(picks_ptr, lens_ptr, lead_ptr, idx_ptr, counts_ptr, H, K, W,
                                  SINKS: tl.constexpr, RECENT: tl.constexpr, EXTRA: tl.constexpr, T: tl.constexpr):
        row = tl.program_id(0)            # b * H + h
        b = row // H
        n = tl.load(lens_ptr + b).to(tl.int64)
        lead = tl.load(lead_ptr + b).to(tl.int64)
        p_cnt = tl.zeros([], tl.int64)
        for t in range(0, K, T):          # picks are compacted: count the valid prefix
            j = t + tl.arange(0, T)
            p = tl.load(picks_ptr + row * K + j, mask=j < K, other=2147483647)
            p_cnt += tl.sum((p < 2147483647).to(tl.int64), 0)
        s_cnt = tl.minimum(tl.maximum(n, 0), SINKS)
        start = tl.maximum(lead - RECENT, SINKS)
        r_cnt = tl.minimum(tl.maximum(n - start, 0), RECENT + EXTRA)
        for t in range(0, W, T):
            j = (t + tl.arange(0, T)).to(tl.int64)
            in_pick = (j >= s_cnt) & (j < s_cnt + p_cnt)
            p = tl.load(picks_ptr + row * K + (j - s_cnt), mask=in_pick, other=0).to(tl.int64)
            out = tl.where(j < s_cnt, j, tl.where(in_pick, p, tl.where(j < s_cnt + p_cnt + r_cnt,
                                                                       start + (j - s_cnt - p_cnt), 2147483647)))
            tl.store(idx_ptr + row * W + j, out.to(tl.int32), mask=j < W)
        if row % H == 0:
            tl.store(counts_ptr + b, (s_cnt + p_cnt + r_cnt).to(tl.int32))


def compose_selection_triton(picks, seq_lens, n_lead, sinks: int, recent: int, extra: int = 0):
    B, H, K = picks.shape
    W = sinks + K + recent + extra
    picks = picks.to(torch.int32).contiguous()
    idx = torch.empty(B, H, W, dtype=torch.int32, device=picks.device)
    counts = torch.empty(B, dtype=torch.int32, device=picks.device)
    if B:
        _compose_selection_kernel[(B * H,)](picks, seq_lens.contiguous(), n_lead.contiguous(), idx, counts, H, K, W,
                                            SINKS=sinks, RECENT=recent, EXTRA=extra, T=1024)
    return idx, counts


def compose_selection(picks, seq_lens, n_lead, sinks: int, recent: int, extra: int = 0):
    """See the module docstring. Triton on CUDA (and under TRITON_INTERPRET=1), the reference otherwise."""
    if triton is not None and (picks.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return compose_selection_triton(picks, seq_lens, n_lead, sinks, recent, extra)
    return compose_selection_ref(picks, seq_lens, n_lead, sinks, recent, extra)


def select_top_k(scores, k: int, seq_lens, sinks: int, recent: int, hist=None):
    """compose_selection(topk_positions(scores, k, SENTINEL, hist), seq_lens, seq_lens, sinks, recent) for scores
    [B, H, N] (sinks and recent at -inf): the same (idx, counts). Triton: top-k's compaction writes the composed rows
    (one kernel less per layer and step); otherwise the two steps."""
    if COMPOSE_IN_TOPK and triton is not None and (scores.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return topk_positions_triton(scores, k, SENTINEL, hist=hist, compose=(seq_lens.contiguous(), sinks, recent))
    return compose_selection(topk_positions(scores, k, SENTINEL, hist=hist), seq_lens, seq_lens, sinks, recent)
