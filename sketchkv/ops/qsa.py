"""QSA selection (the qwen4_exp indexer), as transformers' Qwen4ExpTextQSAIndexer trained it.

With c = indexer_compress_ratio, index block g holds tokens g*c .. g*c + c - 1. A query at position p
sees the complete blocks g < (p + 1) // c and the incomplete tail (p + 1) // c * c .. p. Each block
key is the fp32 mean of its c raw index keys (rounded to the model dtype), RMSNormed, RoPE'd at
the block's first position. score[g] = sum_h relu(q_h . K_g) / sqrt(D) in fp32; the query attends
exactly over the top budget // c blocks plus the tail. A query whose complete blocks number at
most budget // c therefore attends densely.

Selections are token positions in the sparse-attention layout (ops/sparse_attention.py): ascending,
padded with SENTINEL, with a count per row. Two implementations of one selection:
  - `block_scores` + `select_positions`: PyTorch, a batched matmul over slices of blocks and a masked
    torch.topk; CPU decode and every prefill (the reference checked against transformers).
  - `qsa_block_scores` (ops/qsa_score.py, one Triton kernel reading the block keys straight from the paged
    index) + `select_blocks` (the deterministic `topk_positions`): GPU decode, whose cost stays close to
    the key bytes as the context grows. Same picks up to exactly tied scores.
"""
import math

import torch
import torch.nn.functional as F

from sketchkv.ops.topk import topk_positions

SENTINEL = torch.iinfo(torch.int32).max


def pool_raw_keys(raw: torch.Tensor) -> torch.Tensor:
    """[G, c, D] raw index keys -> [G, D] block means (fp32 mean, rounded to the keys' dtype)."""
    return raw.float().mean(dim=1).to(raw.dtype)


SCORE_BYTES = 128 << 20  # default bound on the per-head products block_scores holds at once
SCORE_SLICE_ALIGN = 256  # blocks; see block_scores


def block_scores(q: torch.Tensor, keys: torch.Tensor, max_bytes: int = SCORE_BYTES) -> torch.Tensor:
    """q [N, H, D] index queries; keys [N, G, D] (per query) or [G, D] (shared) -> [N, G] fp32.

    The per-head products [N, H, G] fp32 (16 MiB per query at 1M tokens: G = 256K blocks x 16 heads)
    are formed a slice of blocks at a time, at most max_bytes each: every slice runs the same einsum
    and relu-sum over heads as the whole tensor would. Slices are a multiple of SCORE_SLICE_ALIGN
    blocks because the CPU reduction handles a slice's ragged end in another order (slices of 32
    blocks change the last bit; 64 and up do not): aligned, the scores are bitwise the one-shot ones
    (tests/test_qwen4_exp.py). Shapes alone fix the slicing: CUDA-graph friendly."""
    N, H, D = q.shape
    G = keys.shape[-2]
    per_block = 4 * max(1, N * H)
    step = max(SCORE_SLICE_ALIGN, max_bytes // per_block // SCORE_SLICE_ALIGN * SCORE_SLICE_ALIGN)
    eq = "nhd,ngd->nhg" if keys.dim() == 3 else "nhd,gd->nhg"
    qf = q.float()
    out = torch.empty(N, G, dtype=torch.float32, device=q.device)
    for g in range(0, G, step):
        s = torch.einsum(eq, qf, keys[..., g:g + step, :].float())
        out[:, g:g + step] = s.relu_().sum(dim=1)  # in place: one [N, H, slice] temporary
    return out.div_(math.sqrt(D))


def select_positions(scores: torch.Tensor, visible: torch.Tensor, block_topk: int, c: int):
    """scores [N, G] over blocks 0..G-1; visible [N] tokens each query sees (its position + 1).

    -> (positions [N, k*c + c - 1] int32 ascending, SENTINEL-padded; counts [N] int32): the tokens of
    the top min(block_topk, complete blocks) complete blocks and of the incomplete tail."""
    N, G = scores.shape
    dev = scores.device
    visible = visible.long()
    nvis = visible // c
    ar_c = torch.arange(c, device=dev)
    k = min(block_topk, G)
    parts = []
    if k > 0:
        g = torch.arange(G, device=dev)
        masked = scores.masked_fill(g[None, :] >= nvis[:, None], float("-inf"))
        top = masked.topk(k, dim=1).indices                                   # [N, k]
        tok = (top[:, :, None] * c + ar_c).flatten(1)                          # [N, k*c]
        valid = (top < nvis[:, None]).repeat_interleave(c, dim=1)
        parts.append(torch.where(valid, tok, SENTINEL))
    return _with_tail(parts, visible, c)


def _with_tail(parts: list, visible: torch.Tensor, c: int):
    """parts: the picked blocks' tokens ([N, k*c], SENTINEL where no pick) + the incomplete tail -> positions
    ascending, SENTINEL-padded, and counts (int32)."""
    ar_c = torch.arange(c, device=visible.device)
    tail = visible[:, None] // c * c + ar_c[None, : c - 1]
    parts = parts + [torch.where(tail < visible[:, None], tail, SENTINEL)]
    idx = torch.sort(torch.cat(parts, dim=1), dim=1).values
    counts = (idx < SENTINEL).sum(dim=1).to(torch.int32)
    return idx.to(torch.int32), counts


def select_blocks(scores: torch.Tensor, visible: torch.Tensor, block_topk: int, c: int):
    """`select_positions` for scores that are already -inf at every block a query cannot see (g >= visible // c:
    qsa_block_scores writes them so) -> the same (positions, counts) wherever the scores have no exact tie
    at the k-th value. The top-k is `topk_positions` (ascending block ids, -inf excluded, ties to the lower
    block) instead of a masked copy + torch.topk. Static shapes, no host sync: CUDA-graph capturable."""
    k = min(block_topk, scores.shape[1])
    parts = []
    if k > 0:
        # ascending block ids, then SENTINEL padding: the sort in _with_tail (over [N, k*c + c - 1]) moves
        # the padding behind the tail
        top = topk_positions(scores, k, SENTINEL).long()[:, :, None]          # [N, k, 1]
        ar_c = torch.arange(c, device=scores.device)
        parts.append(torch.where(top < SENTINEL, top * c + ar_c, SENTINEL).flatten(1))
    return _with_tail(parts, visible.long(), c)


def positions_to_mask(idx: torch.Tensor, length: int) -> torch.Tensor:
    """[N, n] positions (SENTINEL-padded) -> [N, length] bool."""
    mask = torch.zeros(idx.shape[0], length + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx.long().clamp_max(length), True)
    return mask[:, :length]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q [n, Hq, D] over k / v [L, Hkv, D] with mask [n, L] (True = attend) -> [n, Hq, D]. SDPA with
    a boolean mask (CPU / GPU); the selected rows are exact, every other row is excluded."""
    G = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(G, dim=1) if G > 1 else k
    vv = v.repeat_interleave(G, dim=1) if G > 1 else v
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk.transpose(0, 1)[None].to(q.dtype),
                                       vv.transpose(0, 1)[None].to(q.dtype), attn_mask=mask[None, None],
                                       scale=scale)
    return o[0].transpose(0, 1)
