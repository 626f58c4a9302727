"""The hot buffer's admit (windowed CLOCK, sketchkv/kv/hot_buffer.py) as one Triton kernel per layer.

`HotBuffer.admit` is the PyTorch formulation (~30 small kernels per layer and step) and the reference:
same semantics, spelled out one miss at a time by `SequentialClock` in tests/test_host_tier.py. Here
one program per sequence of the batch walks its partition:
  A. its misses in order (tiles, running count): the first `cap - used` fill the free rows in row
     order; the k-th of the rest is remembered as the k-th CLOCK miss (a scratch list);
  B. one lap over the rows resident when the step began, from the hand (tiles, running carries):
     candidates are the unreferenced rows and every W-th row of a run of referenced ones; the c-th
     candidate is the victim of the c-th CLOCK miss; referenced rows before the last victim lose
     their bit (all of them when the lap runs out); hand and used advance;
  C. installs: a victim's old key leaves the map (only where the map still points at it), the new key
     enters, the row's key and bit are set.
A second kernel, one program per (sequence, tile of rows), copies the admitted rows (the host tier: the
misses' host records, as its gather kept them) from the step's scratch into the pool.
Before it, `admit_candidates_triton` (two kernels; reference `admit_candidates_ref`) drops keys already
resident and repeats of a key within the batch (a prefix-shared miss is admitted once, by its first row).
Interpreter-tested against the PyTorch admit; GPU-tested (runs 13, 16); measured in run 17 (0.85 ms per
27B step at 8 x 250K for 16 layers): the engine's default (SparseConfig.tier_kernel).
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _clock_admit_kernel(keys_ptr, pids_ptr, base_ptr, cap_ptr, hand_ptr, used_ptr, ref_ptr, key_ptr, map_ptr,
                            rows_ptr, misspos_ptr,
                            N: tl.constexpr, W: tl.constexpr, TN: tl.constexpr, TC: tl.constexpr):
        # N (misses per row), W: fixed per engine (constexpr; the interpreter also needs constant for-loop
        # bounds)
        b = tl.program_id(0)
        pid = tl.load(pids_ptr + b)
        base = tl.load(base_ptr + pid)
        cap = tl.load(cap_ptr + pid)
        hand = tl.load(hand_ptr + pid)
        used = tl.load(used_ptr + pid)
        n_free = cap - used
        lap = tl.maximum(used, 1)
        # A. ranks of the misses: free rows first, the rest queue for CLOCK
        M = tl.zeros([], tl.int64)  # loop-carried values keep one type (the compiler checks; the interpreter does not)
        for t in range(0, N, TN):
            j = t + tl.arange(0, TN)
            k = tl.load(keys_ptr + b * N + j, mask=j < N, other=-1)
            v = (k >= 0).to(tl.int64)
            rank = M + tl.cumsum(v, 0) - 1
            free = (v > 0) & (rank < n_free)
            tl.store(rows_ptr + b * N + j, tl.where(free, base + used + rank, -1), mask=j < N)
            tl.store(misspos_ptr + b * N + (rank - n_free), j.to(tl.int32), mask=(v > 0) & (rank >= n_free))
            M += tl.sum(v, 0)
        n_clock = tl.maximum(M - n_free, 0)
        tl.debug_barrier()
        # B. one lap from the hand over the rows resident at the step's start, stopping once every CLOCK
        # miss has its victim: tiles after that would change nothing (no victim, no bit cleared), and a
        # loop over the whole partition bound cost ~110 us per layer (H200 run 20, 26K-row partitions)
        last_unref = tl.full([], -1, tl.int64)
        n_cand = tl.zeros([], tl.int64)
        last_j = tl.full([], -1, tl.int64)
        t = tl.zeros([], tl.int64)
        while (t < used) & (n_cand < n_clock):
            j = t + tl.arange(0, TC)
            jm = j < used
            row = base + (hand + j) % lap
            refj = (tl.load(ref_ptr + row, mask=jm, other=0) != 0) & jm
            run = tl.maximum(tl.associative_scan(tl.where(refj, -1, j), 0, _max), last_unref)  # last unreferenced row <= j
            cand = jm & (~refj | ((j - run) % W == 0))
            crank = n_cand + tl.cumsum(cand.to(tl.int64), 0) - 1
            victim = cand & (crank < n_clock)
            before = crank + 1 - cand.to(tl.int64)   # candidates before j
            tl.store(ref_ptr + row, tl.zeros([TC], tl.uint8), mask=refj & (before < n_clock))
            m = tl.load(misspos_ptr + b * N + crank, mask=victim, other=0)
            tl.store(rows_ptr + b * N + m, row, mask=victim)
            last_j = tl.maximum(last_j, tl.max(tl.where(victim, j, -1), 0))
            last_unref = tl.maximum(last_unref, tl.max(tl.where(refj | ~jm, -1, j), 0))
            n_cand += tl.sum(cand.to(tl.int64), 0)
            t += TC
        n_placed = tl.minimum(n_clock, n_cand)
        capc = tl.maximum(cap, 1)
        new_hand = tl.where(n_clock > n_cand, (hand + used) % capc, tl.where(n_placed > 0, (hand + last_j + 1) % capc, hand))
        tl.store(hand_ptr + pid, new_hand)
        tl.store(used_ptr + pid, used + tl.minimum(M, n_free))
        tl.debug_barrier()
        # C. installs (the row copies are a second, fully parallel kernel: _copy_rows_kernel)
        for t in range(0, N, TN):
            j = t + tl.arange(0, TN)
            r = tl.load(rows_ptr + b * N + j, mask=j < N, other=-1)
            ok = r >= 0
            k = tl.load(keys_ptr + b * N + j, mask=ok, other=0)
            old = tl.load(key_ptr + r, mask=ok, other=-1)
            had = ok & (old >= 0)
            cur = tl.load(map_ptr + old, mask=had, other=-1).to(tl.int64)
            tl.store(map_ptr + old, tl.full([TN], -1, tl.int64).to(map_ptr.dtype.element_ty), mask=had & (cur == r))
            tl.store(map_ptr + k, r.to(map_ptr.dtype.element_ty), mask=ok)
            tl.store(key_ptr + r, k, mask=ok)
            tl.store(ref_ptr + r, tl.zeros([TN], tl.uint8), mask=ok)

    @triton.jit
    def _copy_rows_kernel(rows_ptr, src_ptr, pool_ptr, N, RW: tl.constexpr, RW_PAD: tl.constexpr, TR: tl.constexpr):
        # program (b, tile): TR of sequence b's admitted rows (RW elements each), scratch -> pool. One
        # program per sequence copying all of them took 61.5 ms per 27B step at 8 x 250K against torch's
        # 52.0 (run 15): 8 programs cannot move ~100 MB per layer; this grid spreads the copies out.
        b = tl.program_id(0)
        j = tl.program_id(1) * TR + tl.arange(0, TR)
        r = tl.load(rows_ptr + b * N + j, mask=j < N, other=-1)
        e = tl.arange(0, RW_PAD)
        ok = (r >= 0)[:, None] & (e < RW)[None, :]
        src = (b * N + j).to(tl.int64)[:, None] * RW + e[None, :]
        tl.store(pool_ptr + r[:, None] * RW + e[None, :], tl.load(src_ptr + src, mask=ok), mask=ok)


if triton is not None:

    @triton.jit
    def _candidates(keys_ptr, map_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        k = tl.load(keys_ptr + i, mask=i < n, other=-1)
        ok = k >= 0
        ok &= tl.load(map_ptr + k, mask=ok, other=0) < 0          # not resident
        return i, k, ok

    @triton.jit
    def _claim_kernel(keys_ptr, map_ptr, claim_ptr, n, BLOCK: tl.constexpr):
        # every candidate key claims its smallest flat index (integer atomics: the result is order-free)
        i, k, ok = _candidates(keys_ptr, map_ptr, n, BLOCK)
        tl.atomic_min(claim_ptr + k, i, mask=ok)

    @triton.jit
    def _first_claim_kernel(keys_ptr, map_ptr, claim_ptr, out_ptr, n, dump, BLOCK: tl.constexpr):
        # the claim's winner resets it (compare-and-swap from its own index): a loser reads the winner's index or
        # the reset value, never its own. tl.atomic_cas has no mask: lanes without a candidate compare against -1,
        # which no slot holds (indices >= 0 or int32 max), each at its own slot i % dump; all on one dump slot
        # they serialised (49 us per layer at 8 x 250K against the claim kernel's 23, H200 run 74).
        i, k, ok = _candidates(keys_ptr, map_ptr, n, BLOCK)
        old = tl.atomic_cas(claim_ptr + tl.where(ok, k, i % dump), tl.where(ok, i, -1),
                            tl.full([BLOCK], 2147483647, tl.int32))
        tl.store(out_ptr + i, tl.where(ok & (old == i), k, -1), mask=i < n)


def admit_candidates_ref(keys: torch.Tensor, hot_map: torch.Tensor, claim: torch.Tensor) -> torch.Tensor:
    """keys [B, N] host slots (< 0: nothing) -> the same with -1 for a key already resident (hot_map, the layer's;
    its last entry: the dump key) or picked by an earlier row of the batch (row-major: a prefix-shared miss is
    admitted once, by its first row). claim: int32 [num_slots + 1] scratch, int32 max everywhere, left so: each
    key claims the smallest flat index among its rows (a scatter-min: deterministic)."""
    dump = hot_map.shape[0] - 1
    valid = keys >= 0
    valid &= hot_map[torch.where(valid, keys, dump)] < 0
    flat = torch.where(valid, keys, dump).flatten()
    idx = torch.arange(flat.numel(), dtype=claim.dtype, device=keys.device)
    claim.scatter_reduce_(0, flat, idx, "amin")
    valid &= (claim[flat] == idx).view_as(keys)
    claim.index_fill_(0, flat, torch.iinfo(claim.dtype).max)
    return torch.where(valid, keys, -1)


def admit_candidates_triton(keys: torch.Tensor, hot_map: torch.Tensor, claim: torch.Tensor) -> torch.Tensor:
    """admit_candidates_ref in two kernels (an atomic-min claim, then a compare-and-swap reset by the winner)."""
    keys = keys.contiguous()
    out = torch.empty_like(keys)
    n, BLOCK = keys.numel(), 1024
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        _claim_kernel[grid](keys, hot_map, claim, n, BLOCK=BLOCK)
        _first_claim_kernel[grid](keys, hot_map, claim, out, n, claim.shape[0] - 1, BLOCK=BLOCK)
    return out


def _words(x: torch.Tensor, lead: int) -> torch.Tensor:
    """x [*lead dims, row...] contiguous -> [*lead, row elements] as int32 words when the row's bytes allow
    (16-byte vector copies of uint8 host records), else in its own dtype."""
    flat = x.reshape(*x.shape[:lead], -1)
    return flat.view(torch.int32) if flat.shape[-1] * flat.element_size() % 4 == 0 else flat


def clock_admit_triton(keys, pids, part_base, part_cap, hand, used, ref, key, hot_map, src, pool,
                       window: int) -> torch.Tensor:
    """keys [B, N] int64: the misses to admit (deduplicated, not resident; -1 elsewhere); pids [B] int64;
    hand / used: the layer's [max_seqs] rows; ref / key: the layer's [P + 1]; hot_map: the layer's map;
    src [B, N, *row]: the misses' rows; pool: the layer's [P + 1, *row]. -> pool rows [B, N] (-1: not
    admitted). Updates the partitions' hand / used, bits, keys, map and rows in place."""
    B, N = keys.shape
    assert pool.is_contiguous() and pool.dtype == src.dtype and pool.shape[1:] == src.shape[2:]
    rows = torch.empty(B, N, dtype=torch.int64, device=keys.device)
    misspos = torch.empty(B, N, dtype=torch.int32, device=keys.device)  # phase B reads only what phase A wrote
    if N == 0 or B == 0:
        return rows
    _clock_admit_kernel[(B,)](keys.contiguous(), pids, part_base, part_cap, hand, used, ref, key, hot_map, rows, misspos,
                              N=N, W=window, TN=triton.next_power_of_2(min(max(N, 16), 1024)), TC=1024)
    src_w, pool_w = _words(src.contiguous(), 2), _words(pool, 1)
    RW = src_w.shape[-1]
    RW_PAD = triton.next_power_of_2(RW)
    TR = max(1, 4096 // RW_PAD)
    _copy_rows_kernel[(B, triton.cdiv(N, TR))](rows, src_w, pool_w, N, RW=RW, RW_PAD=RW_PAD, TR=TR)
    return rows
