"""Decode attention over the paged KV cache: PyTorch reference + flash-decoding Triton kernel.

Cache layout (fixed by the engine): k_cache / v_cache [num_blocks, block_size, Hkv, D]; token t of
sequence b is at block block_tables[b, t // block_size], offset t % block_size. block_tables is
[B, max_blocks] int32 padded with -1; seq_lens [B] int32 counts the cached tokens (current included).

Kernel: split-K over the sequence. Grid (B, Hkv, max_splits); each program walks a contiguous range
of BLOCK_N-token tiles of one (sequence, kv head), loads each K/V tile once for all G = Hq/Hkv query
heads of the group, and writes a partial (normalised out, log-sum-exp); a second small kernel merges
the splits. How many splits a sequence uses is decided on the device from seq_lens (work-proportional:
tokens per split = batch tokens / split_target, so a 128K sequence next to short ones gets most of the
programs); unused programs exit at once. The grid and buffers depend on shapes only, so the launch is
CUDA-graph capturable (no host sync, nothing sized by tensor values).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: only the reference path is available
    triton = None


def gather_kv(k_cache, v_cache, block_table_row, length):
    """Contiguous K/V ([length, Hkv, D] each) of one sequence from the paged cache."""
    length = int(length)
    bs = k_cache.shape[1]
    blocks = block_table_row[: (length + bs - 1) // bs].long()
    k = k_cache[blocks].flatten(0, 1)[:length]
    v = v_cache[blocks].flatten(0, 1)[:length]
    return k, v


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """q [B, Hq, D] (query at position seq_len-1) -> out [B, Hq, D] in q.dtype; fp32 math.

    A sequence with seq_len == 0 (batch padding) gets zeros, like the kernel.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, D, dtype=q.dtype, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)
        qb = q[b].float().view(Hkv, G, D)
        s = torch.einsum("hgd,thd->hgt", qb, k.float()) * scale
        o = torch.einsum("hgt,thd->hgd", s.softmax(-1), v.float())
        out[b] = o.reshape(Hq, D).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _split_plan(lens_ptr, last_ptr, b, B, max_splits, split_target,
                    BLOCK_N: tl.constexpr, B_PAD: tl.constexpr, MIN_TILES: tl.constexpr, GROUPED: tl.constexpr):
        """(seq_len, splits used, tiles per split) of sequence b; the same in both kernels.
        Tiles per split come from the whole batch's tile count so the splits over all sequences
        number <= split_target + B (the host sizes that to one wave of programs).
        GROUPED: b is a group of rows, planned by its last row (whose tokens cover the others')."""
        offs = tl.arange(0, B_PAD)
        if GROUPED:
            lens = tl.load(lens_ptr + tl.load(last_ptr + offs, mask=offs < B, other=0), mask=offs < B, other=0)
            seq_len = tl.load(lens_ptr + tl.load(last_ptr + b))
        else:
            lens = tl.load(lens_ptr + offs, mask=offs < B, other=0)
            seq_len = tl.load(lens_ptr + b)
        total = tl.sum((lens + BLOCK_N - 1) // BLOCK_N, 0)
        n_tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.maximum(tl.cdiv(total, split_target), MIN_TILES)
        n_used = tl.minimum(tl.cdiv(n_tiles, per), max_splits)
        per = tl.cdiv(n_tiles, tl.maximum(n_used, 1))  # re-spread when capped by max_splits
        return seq_len, tl.cdiv(n_tiles, tl.maximum(per, 1)), per

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, mo_ptr, mlse_ptr, idx_ptr, first_ptr, last_ptr,
        qk_scale, B, max_splits, split_target,
        stride_qb, stride_qh,
        stride_kn, stride_kt, stride_kh,
        stride_vn, stride_vt, stride_vh,
        stride_btb, stride_ib, stride_ih,
        miss_ptr, hit_ptr, pool_slot_ptr, sk_ptr, sc_ptr, mean_ptr, basis_ptr,
        G: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, B_PAD: tl.constexpr, MIN_TILES: tl.constexpr,
        UPCAST: tl.constexpr, INDEXED: tl.constexpr, QR: tl.constexpr, GROUPED: tl.constexpr,
        OWN_BLOCKS: tl.constexpr = False, KEY_BASE: tl.constexpr = False, R: tl.constexpr = 16,
    ):
        # GROUPED: program (group b, kv head, split) serves the up to QR query rows first[b]..last[b] that
        # attend to prefixes of one token list (block table / index row b): row r to its first seq_lens[r]
        # entries. Each K/V tile is loaded once for all of them: M = QR * G query vectors in one dot
        # (speculative verification with one selection per sequence: 1 + n rows read their picks once).
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        seq_len, n_used, per = _split_plan(lens_ptr, last_ptr, b, B, max_splits, split_target, BLOCK_N, B_PAD,
                                           MIN_TILES, GROUPED)
        Hq = tl.num_programs(1) * G
        t_lo = s * per * BLOCK_N
        t_hi = tl.minimum(t_lo + per * BLOCK_N, seq_len)
        offs_m = tl.arange(0, M_PAD)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        if GROUPED:
            first = tl.load(first_ptr + b)
            last = tl.load(last_ptr + b)
        else:
            first = b
            last = b
        row = first + offs_m // G
        heads = kvh * G + offs_m % G
        # programs past this sequence's split count get an empty token range; masks keep them from
        # loading q or storing anything
        gmask = (offs_m < QR * G) & (row <= last) & (s < n_used)
        q = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        if GROUPED:
            cnt = tl.load(lens_ptr + row, mask=gmask, other=0)
        if UPCAST:  # interpreter: numpy has no bf16 matmul
            q = q.to(tl.float32)
        if KEY_BASE:  # the keys' sketch base in the scores: q . (mean + basis c) = q . mean + (basis^T q) . c
            offs_r = tl.arange(0, R)
            qm = tl.sum(q.to(tl.float32) * tl.load(mean_ptr + kvh * D + offs_d)[None, :], 1)        # [M]
            # q~ = basis^T q in fp32 FMAs over chunks of 8 dims: a dot's fp32 operand tiles in shared memory
            # (48 KB at D = 256, rank 32) would cut the programs per SM the split sizing counts on
            qt = tl.zeros([M_PAD, R], tl.float32)
            for d0 in range(0, D, 8):
                dd = d0 + tl.arange(0, 8)
                qc = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + dd[None, :],
                             mask=gmask[:, None], other=0.0).to(tl.float32)                            # [M, 8]
                bc = tl.load(basis_ptr + kvh * D * R + dd[:, None] * R + offs_r[None, :])               # [8, R]
                qt += tl.sum(qc[:, :, None] * bc[None, :, :], 1)                                         # [M, R]
            # fp16 for the tensor cores (relative 2^-11: below the bf16 rounding of a rewritten key); the
            # coefficients' integers are exact in fp16, their scale applies to the fp32 product
            qt = qt.to(tl.float16)

        m_i = tl.full([M_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, D], tl.float32)
        for t0 in range(t_lo, t_hi, BLOCK_N):
            t = t0 + offs_n
            tmask = t < t_hi
            if INDEXED:  # sparse decode: the t-th selected token's position, from the index list
                pos = tl.load(idx_ptr + b * stride_ib + kvh * stride_ih + t, mask=tmask, other=0)
            else:
                pos = t
            # masked lanes never read the -1 padding of the block table
            if OWN_BLOCKS:  # no table: row b's blocks are b * stride_btb + j
                blk = (b * stride_btb + pos // BLOCK_SIZE).to(tl.int64)
            else:
                blk = tl.load(bt_ptr + b * stride_btb + pos // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            off = pos % BLOCK_SIZE
            k = tl.load(k_ptr + (blk * stride_kn + off * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
                        mask=tmask[:, None], other=0.0)
            v = tl.load(v_ptr + (blk * stride_vn + off * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
                        mask=tmask[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k))
            if KEY_BASE:   # rows read from host records (misses, hot hits) hold k - base; resident rows hold k
                crow = blk * BLOCK_SIZE + off   # the cache row (flat)
                slot = tl.load(miss_ptr + crow, mask=tmask, other=-1)
                hit = tl.load(hit_ptr + crow, mask=tmask & (slot < 0), other=-1)
                slot = tl.where(slot >= 0, slot, tl.load(pool_slot_ptr + tl.maximum(hit, 0), mask=hit >= 0,
                                                         other=-1))
                has = slot >= 0
                sk = tl.maximum(slot, 0).to(tl.int64) * tl.num_programs(1) + kvh
                packed = tl.load(sk_ptr + sk[:, None] * (R // 2) + tl.arange(0, R // 2)[None, :], mask=has[:, None],
                                 other=0).to(tl.int32)
                coeff = tl.reshape(tl.join((packed & 15) - 8, (packed >> 4) - 8), (BLOCK_N, R)).to(tl.float16)
                sc = tl.load(sc_ptr + sk, mask=has, other=0.0).to(tl.float32)
                base = tl.dot(qt, tl.trans(coeff), out_dtype=tl.float32) * sc[None, :] + qm[:, None]
                qk += tl.where(has[None, :], base, 0.0)
            qk = qk * qk_scale  # log2 domain (scale * log2(e) folded in)
            if GROUPED:  # a row past its own count sees nothing of this tile: keep its max finite
                qk = tl.where(tmask[None, :] & (t[None, :] < cnt[:, None]), qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                qk = tl.where(tmask[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: tile has >= 1 valid token
                m_use = m_new
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # a split is never empty by construction; guard anyway so it could only weigh 0
        nonempty = l_i > 0
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        mid = (row * Hq + heads) * max_splits + s  # mid buffers are [rows, Hq, max_splits(, D)] contiguous
        tl.store(mlse_ptr + mid, lse, mask=gmask)
        tl.store(mo_ptr + mid[:, None] * D + offs_d[None, :], o, mask=gmask[:, None])

    @triton.jit
    def _decode_reduce_kernel(
        mo_ptr, mlse_ptr, out_ptr, lens_ptr, group_ptr, last_ptr, B, max_splits, split_target, stride_ob, stride_oh,
        D: tl.constexpr, BLOCK_N: tl.constexpr, B_PAD: tl.constexpr, MIN_TILES: tl.constexpr,
        CHUNK: tl.constexpr, GROUPED: tl.constexpr,
    ):
        b = tl.program_id(0)   # a query row
        h = tl.program_id(1)
        plan = tl.load(group_ptr + b) if GROUPED else b
        _, n_used, _ = _split_plan(lens_ptr, last_ptr, plan, B, max_splits, split_target, BLOCK_N, B_PAD, MIN_TILES,
                                   GROUPED)
        base = (b * tl.num_programs(1) + h) * max_splits
        offs_c = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, D)
        m = tl.full([CHUNK], float("-inf"), tl.float32)
        for s0 in range(0, n_used, CHUNK):  # only the splits this sequence wrote
            m = tl.maximum(m, tl.load(mlse_ptr + base + s0 + offs_c, mask=s0 + offs_c < n_used, other=float("-inf")))
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # seq_len 0: no splits -> output 0
        total = tl.zeros([CHUNK], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, n_used, CHUNK):  # chunked so splits x D never sit in registers at once
            sm = s0 + offs_c < n_used
            w = tl.exp2(tl.load(mlse_ptr + base + s0 + offs_c, mask=sm, other=float("-inf")) - m_max)
            o = tl.load(mo_ptr + (base + s0 + offs_c)[:, None] * D + offs_d[None, :], mask=sm[:, None], other=0.0)
            total += w
            acc += tl.sum(w[:, None] * o, 0)
        out = acc / tl.maximum(tl.sum(total, 0), 1e-30)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))

    # triton picks interpreter vs compiler when the kernel is decorated, i.e. at import time
    _INTERPRETED = not isinstance(_decode_split_kernel, triton.runtime.JITFunction)
else:
    _INTERPRETED = False

_NUM_SMS = {}


def _wave(device):
    """Programs that run at once: ~4 per SM for the default tiles (sm_90, D=256, BLOCK_N=32, 4 warps,
    2 stages: ~118 registers x 128 threads and 42 KB shared per program). CPU: a small stand-in."""
    if device.type != "cuda":
        return 16
    if device.index not in _NUM_SMS:
        _NUM_SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return 4 * _NUM_SMS[device.index]


def paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, *, out=None,
                                  max_splits=None, split_target=None, min_split_tokens=128,
                                  block_n=None, num_warps=None, num_stages=2, indices=None, row_groups=None,
                                  key_base=None):
    """max_splits: most splits one sequence may use (the grid's 3rd dim). split_target: splits over
    the whole batch per kv head, sized so all programs fit one wave (a partial second wave nearly
    doubles the time). min_split_tokens: shorter splits cost more in the merge than they gain.
    All three default from shapes only, so one captured graph serves any seq_lens.
    indices: [B, 1 or Hkv, N] int32 token positions (sparse decode); then seq_lens[b] counts the
    valid entries of row b and the kernel attends to exactly those tokens.
    row_groups (firsts, lasts, group, most_rows): the query rows come in groups firsts[g]..lasts[g] (at most
    most_rows each; group [rows]: each row's g) that attend to prefixes of one token list: block_tables /
    indices then have one row per group, seq_lens one entry per query row (row r attends to the first
    seq_lens[r] tokens of its group's list, the last row of a group to the most), and each K/V tile is
    read once per group. block_tables None: row (or group) b's blocks are b * nb .. b * nb + nb - 1 with
    nb = the cache's blocks / B (a scratch laid out row after row: the host tier's compact rows; no table to
    build each step).
    key_base (miss, hit, pool_slots, sketch, scale, mean, basis): the host tier's residual keys (k - base, see
    ops/sketch_base.py) completed inside the scores instead of rewritten: cache row j (flat: block * block_size +
    offset) has the slot miss[j], else pool_slots[hit[j]] where hit[j] >= 0, else none (a whole key, unchanged);
    with a slot the score adds q . mean + (basis^T q) . coefficients(slot) (q . mean and basis^T q in fp32, rounded to
    fp16 for the tensor-core product with the coefficients' integers; their scale on the fp32 product)."""
    R, Hq, D = q.shape
    firsts, lasts, group, most_rows = row_groups if row_groups is not None else (seq_lens, seq_lens, seq_lens, 1)
    B = firsts.shape[0] if row_groups is not None else R   # programs' sequences: groups, or rows
    _, block_size, Hkv, Dk = k_cache.shape
    own = block_tables is None
    if own:
        assert k_cache.shape[0] % B == 0, "block_tables=None: the cache holds B rows of equally many blocks"
        block_tables = torch.empty(B, k_cache.shape[0] // B, dtype=torch.int32, device=q.device)   # never read
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0
    assert 16 <= D <= 256 and D & (D - 1) == 0, "head_dim must be a power of two in [16, 256]"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert block_tables.stride(-1) == 1 and seq_lens.is_contiguous() and seq_lens.shape == (R,)
    assert block_tables.shape[0] >= B
    G = Hq // Hkv
    m_pad = max(16, triton.next_power_of_2(G * most_rows))
    if num_warps is None:
        num_warps = 4 if m_pad <= 16 else 8   # [M, D] fp32 accumulator: 64 x 256 is 128 registers at 4 warps
    if block_n is None:
        block_n = 32 if D > 128 else 64  # bounds registers for the K and V tiles
    min_tiles = triton.cdiv(min_split_tokens, block_n)
    wave = _wave(q.device) // Hkv  # splits per kv head that fit one wave
    capacity = indices.shape[-1] if indices is not None else block_tables.shape[1] * block_size
    if max_splits is None:
        max_splits = max(1, min(wave, triton.cdiv(capacity, min_tiles * block_n)))
    if split_target is None:
        split_target = max(1, wave - B)  # sum_b ceil(tiles_b / per) <= split_target + B
    mid_o = torch.empty(R, Hq, max_splits, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(R, Hq, max_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    B_PAD = triton.next_power_of_2(B)
    if indices is not None:
        assert indices.dtype == torch.int32 and indices.stride(-1) == 1 and indices.shape[1] in (1, Hkv)
    idx = indices if indices is not None else seq_lens  # dummy pointer when dense
    stride_ib = indices.stride(0) if indices is not None else 0
    stride_ih = indices.stride(1) if indices is not None and indices.shape[1] > 1 else 0
    if key_base is not None:   # (rank, not R: R is the query rows)
        miss, hit, pool_slots, sketch, sk_scale, mean, basis = key_base
        rank = basis.shape[-1]
        assert rank >= 16 and rank & (rank - 1) == 0 and basis.shape == (Hkv, D, rank) and mean.shape == (Hkv, D)
        assert basis.dtype == mean.dtype == torch.float32 and basis.is_contiguous() and mean.is_contiguous()
        assert sketch.is_contiguous() and sk_scale.is_contiguous() and miss.is_contiguous() and hit.is_contiguous()
    else:
        rank, key_base = 16, (None,) * 7
    _decode_split_kernel[(B, Hkv, max_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, idx, firsts, lasts,
        scale * 1.4426950408889634, B, max_splits, split_target,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.shape[1] if own else block_tables.stride(0), stride_ib, stride_ih, *key_base,
        G=G, M_PAD=m_pad, D=D,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, B_PAD=B_PAD, MIN_TILES=min_tiles, UPCAST=_INTERPRETED,
        INDEXED=indices is not None, QR=most_rows, GROUPED=row_groups is not None, OWN_BLOCKS=own,
        KEY_BASE=key_base[0] is not None, R=rank,
        num_warps=num_warps, num_stages=num_stages,
    )
    _decode_reduce_kernel[(R, Hq)](
        mid_o, mid_lse, out, seq_lens, group, lasts, B, max_splits, split_target, out.stride(0), out.stride(1),
        D=D, BLOCK_N=block_n, B_PAD=B_PAD, MIN_TILES=min_tiles, CHUNK=16, GROUPED=row_groups is not None,
        num_warps=4,
    )
    return out


def expand_row_groups(table, row_groups):
    """A per-group tensor (block tables, index lists) repeated for every query row of its group: what the
    reference paths take."""
    return table[row_groups[2]]


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, *, out=None, row_groups=None,
                           key_base=None, **kw):
    """Decode attention, q [B, Hq, D] -> [B, Hq, D]. Triton on CUDA or under TRITON_INTERPRET=1
    (kw: the kernel's tuning knobs, see paged_attention_decode_triton); the reference otherwise (key_base: the
    keys completed by ops.sketch_base first, in fp32)."""
    if q.is_cuda or (_INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"):
        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,
                                             row_groups=row_groups, key_base=key_base, **kw)
    if key_base is not None:
        from sketchkv.ops.sketch_base import apply_sketch_base
        miss, hit, pool_slots, sketch, sk_scale, mean, basis = key_base
        kf = k_cache.reshape(-1, *k_cache.shape[2:])
        kf = apply_sketch_base(kf, miss, sketch, sk_scale, mean, basis, +1,
                               out=torch.empty(kf.shape, dtype=torch.float32, device=kf.device),
                               hits=hit, pool_slots=pool_slots)
        k_cache = kf.view(k_cache.shape)
    if block_tables is None:   # row (group) b's own blocks, see paged_attention_decode_triton
        B = row_groups[0].shape[0] if row_groups is not None else q.shape[0]
        nb = k_cache.shape[0] // B
        block_tables = torch.arange(B * nb, dtype=torch.int32, device=q.device).view(B, nb)
    if row_groups is not None:
        block_tables = expand_row_groups(block_tables, row_groups)
    res = paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return res if out is None else out.copy_(res)
