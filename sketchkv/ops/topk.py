"""Deterministic top-k over selection scores: same input, same picks; ties go to the earlier position.

Scores are packed with their position into unique int64 keys (order-preserving float bits in the
high word, inverted position in the low word), so the select has no ties to break arbitrarily.
On CUDA torch.topk runs a radix select over those keys; the reference is a stable sort.
`topk_positions` (what the engine uses) finds only the k-th value with a float top-k and compacts
the positions in order: PyTorch version + Triton version (a radix select's four histogram passes, a count and an
ordered compaction: 7 launches; 5 when the kernel that writes the scores counts the first round, `hist`) + dispatch.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _keys(scores: torch.Tensor) -> torch.Tensor:
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    # IEEE float -> monotone integer: flip all bits of negatives, the sign bit of positives.
    ordered = torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    pos = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return ((ordered - (1 << 31)) << 32) | (0xFFFFFFFF - pos)


def topk_ref(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., N] -> (values, positions) of the k best, best first, ties by lower position."""
    order = torch.sort(-scores.float(), dim=-1, stable=True).indices[..., :k]
    return scores.gather(-1, order), order


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = _keys(scores)
    top = torch.topk(keys, k, dim=-1, sorted=True).values
    pos = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    return scores.gather(-1, pos), pos


def topk_positions_torch(scores: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """Positions of the k best scores above -inf (the masked positions), ascending, int32, padded with `fill` -> [..., k].

    Same set as `topk_ref` (ties go to the earlier position) but without 64-bit keys: a float
    top-k only finds the k-th value; every position above it is taken, then positions equal to
    it in order until k are taken (a cumulative sum), and a scatter compacts them in position
    order. Elementwise passes over the scores cost far less than selecting over int64 keys
    (H200, 8 x 250K: fp32 torch.topk 116 us vs packed keys 428 us). Static shapes, no host sync.
    """
    kth = torch.topk(scores, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    gt = scores > kth
    eq = scores == kth
    need = k - gt.sum(-1, keepdim=True)
    take = (gt | (eq & (torch.cumsum(eq, -1, dtype=torch.int32) <= need))) & (scores > float("-inf"))
    col = torch.where(take, torch.cumsum(take, -1, dtype=torch.int32) - 1, k).long()
    out = torch.full((*scores.shape[:-1], k + 1), fill, dtype=torch.int32, device=scores.device)
    pos = torch.arange(scores.shape[-1], dtype=torch.int32, device=scores.device).expand_as(col)
    out.scatter_(-1, col, torch.where(take, pos, fill))  # untaken positions all land in the spare column k
    return out[..., :k]


if triton is not None:

    @triton.jit
    def _ordered(x):
        # float bits -> uint32 whose unsigned order is the float order: flip every bit of a negative, the
        # sign bit of a positive
        u = x.to(tl.uint32, bitcast=True)
        return u ^ tl.where((u >> 31) == 1, 0xFFFFFFFF, 0x80000000).to(tl.uint32)

    @triton.jit
    def first_digit_histogram(x, mask):
        """The first radix round's 256-bin histogram of scores x (the top 8 bits of their order-preserving keys) where
        mask: what a kernel that writes the scores adds into hist[0, row] (atomics) to spare top-k that pass."""
        return tl.histogram(((_ordered(x) >> 24) & 255).to(tl.int32), 256, mask=mask)

    @triton.jit
    def _radix_prefix(hist_ptr, row, rows, k0, ROUNDS: tl.constexpr):
        # the digits of the k0-th largest key fixed by the first ROUNDS radix rounds, from their complete histograms
        # (hist [4, rows, 256]), each round counting from the top digit down -> (those digits in the low 8 * ROUNDS
        # bits, k left among the keys that share them). Every program of the next kernel recomputes it (at most 4 KB
        # of L2 reads): no one-program pick kernel between the rounds.
        d = tl.arange(0, 256)
        prefix = tl.zeros([], tl.uint32)
        k = k0
        for r in tl.static_range(ROUNDS):
            h = tl.load(hist_ptr + (r * rows + row) * 256 + d)
            at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h            # keys with digit >= d
            digit = tl.sum((at_or_above >= k).to(tl.int32), 0) - 1
            k -= tl.sum(tl.where(d > digit, h, 0), 0)
            prefix = (prefix << 8) | digit.to(tl.uint32)
        return prefix, k

    @triton.jit
    def _kth_value(kth_ptr, hist_ptr, row, rows, k0, FROM_HIST: tl.constexpr):
        # the row's k-th largest score: from the four rounds' histograms, or as given (kth_ptr [rows])
        if FROM_HIST:
            u, _ = _radix_prefix(hist_ptr, row, rows, k0, 4)
            u = u ^ tl.where((u >> 31) == 1, 0x80000000, 0xFFFFFFFF).to(tl.uint32)   # _ordered's inverse
            return u.to(tl.float32, bitcast=True)
        return tl.load(kth_ptr + row)

    @triton.jit
    def _above_kth(s_ptr, kth, row, chunk, N, stride_s, CH: tl.constexpr):
        offs = chunk * CH + tl.arange(0, CH)
        x = tl.load(s_ptr + row * stride_s + offs, mask=offs < N, other=float("-inf"))
        return offs, x > kth, (x == kth) & (x > float("-inf"))

    @triton.jit
    def _count_kernel(s_ptr, kth_ptr, hist_ptr, cnt_ptr, N, K, rows, stride_s, CH: tl.constexpr,
                      FROM_HIST: tl.constexpr):
        # per (row, chunk): how many scores are above the k-th value, how many equal it
        row, chunk = tl.program_id(0), tl.program_id(1)
        kth = _kth_value(kth_ptr, hist_ptr, row, rows, K, FROM_HIST)
        _, gt, eq = _above_kth(s_ptr, kth, row, chunk, N, stride_s, CH)
        base = cnt_ptr + (row * tl.num_programs(1) + chunk) * 2
        tl.store(base, tl.sum(gt.to(tl.int32), 0))
        tl.store(base + 1, tl.sum(eq.to(tl.int32), 0))

    @triton.jit
    def _compact_kernel(s_ptr, kth_ptr, hist_ptr, cnt_ptr, out_ptr, N, K, rows, fill, stride_s, stride_o,
                        lens_ptr, sel_counts_ptr, H, sinks, recent,
                        CH: tl.constexpr, NCP: tl.constexpr, FROM_HIST: tl.constexpr, COMPOSE: tl.constexpr = False):
        # every score above the k-th value is taken, equal ones in position order until `need` = k - (all
        # above); each chunk writes its picks after those of the chunks before it (it sums their counts: a
        # row has at most NCP chunks), and chunk 0 pads the row's untaken tail with `fill`.
        # COMPOSE (selection.select_top_k): rows are (sequence b = row // H, selection head); the row of out
        # (stride_o = sinks + K + recent) is compose_selection's: the sinks, the picks, the recent window, `fill`
        # after; chunk 0 writes all but the picks, and head 0 the sequence's count to sel_counts_ptr [B]
        row, chunk = tl.program_id(0), tl.program_id(1)
        kth = _kth_value(kth_ptr, hist_ptr, row, rows, K, FROM_HIST)
        offs, gt, eq = _above_kth(s_ptr, kth, row, chunk, N, stride_s, CH)
        c = tl.arange(0, NCP)
        nch = tl.num_programs(1)
        cnt = cnt_ptr + (row * nch + c) * 2
        gts = tl.load(cnt, mask=c < nch, other=0)
        eqs = tl.load(cnt + 1, mask=c < nch, other=0)
        gt_before = tl.sum(tl.where(c < chunk, gts, 0), 0)
        eq_before = tl.sum(tl.where(c < chunk, eqs, 0), 0)
        need = K - tl.sum(gts, 0)
        take = gt | (eq & (eq_before + tl.cumsum(eq.to(tl.int32), 0) <= need))
        col = gt_before + tl.minimum(eq_before, tl.maximum(need, 0)) + tl.cumsum(take.to(tl.int32), 0) - 1
        if COMPOSE:
            n = tl.maximum(tl.load(lens_ptr + row // H), 0)
            s_cnt = tl.minimum(n, sinks)
            start = tl.maximum(n - recent, sinks)
            r_cnt = tl.minimum(tl.maximum(n - start, 0), recent)
        else:
            s_cnt = 0
        tl.store(out_ptr + row * stride_o + s_cnt + col, offs, mask=take & (col < K))
        if chunk == 0:
            taken = tl.minimum(tl.sum(gts, 0) + tl.minimum(tl.sum(eqs, 0), tl.maximum(need, 0)), K)
            if COMPOSE:
                for t in range(0, stride_o, CH):
                    j = t + tl.arange(0, CH)
                    r = j - s_cnt - taken              # index in the recent window
                    v = tl.where(j < s_cnt, j, tl.where(r < r_cnt, start + r, fill))
                    tl.store(out_ptr + row * stride_o + j, v, mask=((j < s_cnt) | (r >= 0)) & (j < stride_o))
                if row % H == 0:
                    tl.store(sel_counts_ptr + row // H, s_cnt + taken + r_cnt)
            else:
                for t in range(0, K, CH):
                    j = t + tl.arange(0, CH)
                    tl.store(out_ptr + row * stride_o + j, tl.full([CH], fill, tl.int32), mask=(j >= taken) & (j < K))

    @triton.jit
    def _radix_hist_kernel(s_ptr, hist_ptr, N, rows, k0, iters, programs, stride_s, SHIFT: tl.constexpr,
                           TILE: tl.constexpr):
        # one radix round, program (row, p): tiles p, p + programs, ... (iters of them) of the row; among the keys whose
        # higher digits equal the earlier rounds' (recomputed from their histograms), histogram the 8-bit digit at
        # SHIFT -> hist[round, row]
        row, p = tl.program_id(0), tl.program_id(1)
        ROUND: tl.constexpr = (24 - SHIFT) // 8
        if SHIFT < 24:
            prefix, _ = _radix_prefix(hist_ptr, row, rows, k0, ROUND)
            prefix = prefix << (SHIFT + 8)
        else:  # the first round: no digit fixed yet
            prefix = tl.zeros([], tl.uint32)
        high = (0xFFFFFFFF << (SHIFT + 8)) if SHIFT < 24 else 0    # the digits already fixed
        acc = tl.zeros((256,), tl.int32)
        for i in range(iters):
            offs = (p + i * programs) * TILE + tl.arange(0, TILE)
            x = tl.load(s_ptr + row * stride_s + offs, mask=offs < N, other=0.0)
            key = _ordered(x)
            match = (offs < N) & ((key & high) == (prefix & high))
            if SHIFT == 24:   # the count a kernel that writes the scores can make instead (sketch_score's radix_hist)
                acc += first_digit_histogram(x, match)
            else:
                acc += tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=match)
        tl.atomic_add(hist_ptr + (ROUND * rows + row) * 256 + tl.arange(0, 256), acc)

    @triton.jit
    def _radix_kth_kernel(hist_ptr, kth_ptr, rows, k0):
        # kth_largest_triton's last step: the k-th value from the four histograms
        row = tl.program_id(0)
        tl.store(kth_ptr + row, _kth_value(kth_ptr, hist_ptr, row, rows, k0, True))


def kth_largest_torch(s: torch.Tensor, k: int) -> torch.Tensor:
    """s [rows, N] fp32 -> the k-th largest value of each row [rows] (-inf counts like any value)."""
    return torch.topk(s, k, dim=-1, sorted=False).values.amin(-1)


# The scoring kernels count top-k's first radix round as they write the scores (radix_hist_buffer); False: top-k
# counts it itself (benchmarks: the same picks, two launches and one pass over the scores more per call).
SCORING_COUNTS_FIRST_ROUND = True


def radix_hist_buffer(rows: int, device: torch.device) -> torch.Tensor | None:
    """An uninitialised [4, rows, 256] int32 for a scoring kernel to fill (round 0 counted, rounds 1-3 zeroed; see
    topk_positions' hist); None where topk_positions takes the PyTorch path (or SCORING_COUNTS_FIRST_ROUND is off)."""
    if triton is None or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    if not SCORING_COUNTS_FIRST_ROUND:
        return None
    return torch.empty(4, rows, 256, dtype=torch.int32, device=device)


def radix_histograms(s: torch.Tensor, k: int, hist: torch.Tensor | None = None,
                     rounds: tuple[int, ...] = (0, 1, 2, 3)) -> torch.Tensor:
    """s [rows, N] fp32 -> hist [4, rows, 256] int32: the four radix rounds of the k-th largest key (8-bit digits of
    the order-preserving keys, most significant first), each a histogram pass over the row among the keys that share
    the digits the earlier rounds fixed (integer atomics: deterministic). A memset and 4 launches; the digits are
    read back from the histograms by whoever needs them (_radix_prefix). hist: the buffer to count into instead of a
    fresh zeroed one, holding the counts of the rounds not in `rounds` and zeros in those that are (topk_positions'
    hist: round 0 counted by the kernel that wrote s, rounds (1, 2, 3) left)."""
    rows, N = s.shape
    TILE = 2048
    # up to ~1K programs: at 256 (~2 per SM at 8 rows, 4 tiles each) a round took 12 us per layer at 8 x 250K,
    # latency-bound (H200 run 38)
    programs = max(1, min(triton.cdiv(N, TILE), 1024 // max(rows, 1)))
    if hist is None:
        hist = torch.zeros(4, rows, 256, dtype=torch.int32, device=s.device)
    assert hist.shape == (4, rows, 256) and hist.dtype == torch.int32 and hist.is_contiguous(), hist.shape
    shifts = [24 - 8 * r for r in rounds]
    for shift in shifts:
        _radix_hist_kernel[(rows, programs)](s, hist, N, rows, k, triton.cdiv(N, TILE * programs), programs,
                                             s.stride(0), SHIFT=shift, TILE=TILE)
    return hist


def kth_largest_triton(s: torch.Tensor, k: int) -> torch.Tensor:
    """kth_largest_torch bit for bit, by radix select (radix_histograms, then one kernel reads the k-th value out of
    them); torch.topk sorts rows of >= 100K scores when there are <= 10 rows (its heuristic), which cost ~150 us
    per layer at 8 x 250K on the H200 (run 24)."""
    rows = s.shape[0]
    hist = radix_histograms(s, k)
    kth = torch.empty(rows, dtype=torch.float32, device=s.device)
    _radix_kth_kernel[(rows,)](hist, kth, rows, k)
    return kth


def topk_positions_triton(scores: torch.Tensor, k: int, fill: int, kth=None, hist=None, compose=None):
    """kth: a function giving the k-th values (kth_largest_torch, kth_largest_triton: the same); by default the
    count and compaction kernels read the k-th value out of radix_histograms' rounds themselves (7 launches: a
    memset, 4 histogram passes, count, compaction; it was 11 with a pick kernel after each round; 5 with `hist`,
    round 0 counted by the kernel that wrote the scores). compose = (seq_lens [B], sinks, recent), scores
    [B, H, N]: the compaction writes compose_selection's rows instead (selection.select_top_k) -> (idx, counts)."""
    N = scores.shape[-1]
    s = scores.reshape(-1, N).float().contiguous()
    rows = s.shape[0]
    if kth is None:
        hist = radix_histograms(s, k) if hist is None else radix_histograms(s, k, hist, rounds=(1, 2, 3))
        kth_t = s   # unused pointer
    else:
        hist, kth_t = s, kth(s, k)                # hist: unused pointer
    CH = 2048
    grid = (rows, triton.cdiv(N, CH))
    counts = torch.empty(rows, grid[1], 2, dtype=torch.int32, device=s.device)
    from_hist = kth is None
    _count_kernel[grid](s, kth_t, hist, counts, N, k, rows, s.stride(0), CH=CH, FROM_HIST=from_hist)
    if compose is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=s.device)
        lens, sel_counts, H, sinks, recent = counts, counts, 1, 0, 0     # (unused)
    else:
        lens, sinks, recent = compose
        B, H = scores.shape[0], scores.shape[1]
        out = torch.empty(rows, sinks + k + recent, dtype=torch.int32, device=s.device)
        sel_counts = torch.empty(B, dtype=torch.int32, device=s.device)
    _compact_kernel[grid](s, kth_t, hist, counts, out, N, k, rows, fill, s.stride(0), out.stride(0), lens,
                          sel_counts, H, sinks, recent, CH=CH, NCP=max(16, triton.next_power_of_2(grid[1])),
                          FROM_HIST=from_hist, COMPOSE=compose is not None)
    if compose is not None:
        return out.view(B, H, -1), sel_counts
    return out.view(*scores.shape[:-1], k)


def topk_positions(scores: torch.Tensor, k: int, fill: int, hist: torch.Tensor | None = None) -> torch.Tensor:
    """Positions of the k best scores above -inf, ascending, int32, padded with `fill` -> [..., k]
    (see topk_positions_torch; the Triton path gives the same tensor). hist: [4, rows, 256] int32 (rows = the
    scores' rows, flattened) with the first radix round counted and rounds 1-3 zero, by whoever wrote the scores
    (sketch_score's radix_hist); the PyTorch path ignores it."""
    if triton is not None and (scores.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return topk_positions_triton(scores, k, fill, hist=hist)
    return topk_positions_torch(scores, k, fill)
