"""Decode attention over the paged KV cache: PyTorch reference + flash-decoding Triton kernel.

Cache layout (fixed by the engine): k_cache / v_cache [num_blocks, block_size, Hkv, D]; token t of
sequence b is at block block_tables[b, t // block_size], offset t % block_size. block_tables is
[B, max_blocks] int32 padded with -1; seq_lens [B] int32 counts the cached tokens (current included).

Kernel: split-K over the sequence. Grid (B, Hkv, num_splits); each program walks a contiguous range
of BLOCK_N-token tiles of one (sequence, kv head), loads each K/V tile once for all G = Hq/Hkv query
heads of the group, and writes a partial (normalised out, log-sum-exp). A second small kernel merges
the splits. The split count is fixed by shapes only (never by seq_lens values) and each sequence
divides its own length over the splits inside the kernel, so the launch is CUDA-graph capturable.
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
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, mo_ptr, mlse_ptr,
        qk_scale, num_splits,
        stride_qb, stride_qh,
        stride_kn, stride_kt, stride_kh,
        stride_vn, stride_vt, stride_vh,
        stride_btb,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        Hq = tl.num_programs(1) * G
        seq_len = tl.load(lens_ptr + b)
        # this split's token range: the sequence's tiles divided evenly over num_splits
        n_tiles = tl.cdiv(seq_len, BLOCK_N)
        per = tl.cdiv(n_tiles, num_splits)
        t_lo = s * per * BLOCK_N
        t_hi = tl.minimum(t_lo + per * BLOCK_N, seq_len)

        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * G + offs_g
        gmask = offs_g < G
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        if UPCAST:  # interpreter: numpy has no bf16 matmul
            q = q.to(tl.float32)

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for t0 in range(t_lo, t_hi, BLOCK_N):
            t = t0 + offs_n
            tmask = t < t_hi
            # masked lanes never read the -1 padding of the block table
            blk = tl.load(bt_ptr + b * stride_btb + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            off = t % BLOCK_SIZE
            k = tl.load(k_ptr + (blk * stride_kn + off * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
                        mask=tmask[:, None], other=0.0)
            v = tl.load(v_ptr + (blk * stride_vn + off * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
                        mask=tmask[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain (scale * log2(e) folded in)
            qk = tl.where(tmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: tile has >= 1 valid token
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # empty split (short sequence): out 0, lse -inf -> weight 0 in the merge
        nonempty = l_i > 0
        o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = (b * Hq + heads) * num_splits + s  # mid buffers are [B, Hq, num_splits(, D)] contiguous
        tl.store(mlse_ptr + row, lse, mask=gmask)
        tl.store(mo_ptr + row[:, None] * D + offs_d[None, :], o, mask=gmask[:, None])

    @triton.jit
    def _decode_reduce_kernel(
        mo_ptr, mlse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
        D: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        row = b * tl.num_programs(1) + h
        offs_s = tl.arange(0, S_PAD)
        lse = tl.load(mlse_ptr + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0: every split empty -> output 0
        total = tl.sum(tl.exp2(lse - m), 0)
        offs_c = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, num_splits, CHUNK):  # chunked so S x D never sits in registers at once
            sm = s0 + offs_c < num_splits
            w = tl.exp2(tl.load(mlse_ptr + row * num_splits + s0 + offs_c, mask=sm, other=float("-inf")) - m)
            o = tl.load(mo_ptr + (row * num_splits + s0 + offs_c)[:, None] * D + offs_d[None, :],
                        mask=sm[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o, 0)
        out = acc / tl.maximum(total, 1e-30)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))

    # triton picks interpreter vs compiler when the kernel is decorated, i.e. at import time
    _INTERPRETED = not isinstance(_decode_split_kernel, triton.runtime.JITFunction)

    if _INTERPRETED:
        # triton 3.6's interpreter does int(1-element array) for runtime loop bounds, a TypeError
        # since numpy 2.4 (triton#9171). Same one-line fix as upstream PR #9172; idempotent.
        from triton.runtime import interpreter as _ti

        if not getattr(_ti._patch_lang_tensor, "_sketchkv_fix", False):
            _orig_patch = _ti._patch_lang_tensor

            def _patch_lang_tensor(tensor, scope):
                _orig_patch(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

            _patch_lang_tensor._sketchkv_fix = True
            _ti._patch_lang_tensor = _patch_lang_tensor
else:
    _INTERPRETED = False

_NUM_SMS = {}


def _default_num_splits(B, Hkv, capacity, device):
    """Split count from shapes only, so a captured CUDA graph stays valid for any seq_lens."""
    if device.type != "cuda":
        return max(1, min(4, triton.cdiv(capacity, 64)))
    if device.index not in _NUM_SMS:
        _NUM_SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    # One wave of ~4 programs per SM (floor: a partial second wave nearly doubles the time, H200
    # B=8 Hkv=4: 17 splits 1.42 ms vs 16 splits 0.97 ms), and >= ~1K tokens of capacity per split
    # so the merge stays cheap for short contexts.
    return max(1, min(4 * _NUM_SMS[device.index] // (B * Hkv), triton.cdiv(capacity, 1024), 256))


def paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, *,
                                  num_splits=None, out=None, block_n=None, num_warps=4, num_stages=2):
    B, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0
    assert 16 <= D <= 256 and D & (D - 1) == 0, "head_dim must be a power of two in [16, 256]"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert block_tables.stride(-1) == 1 and seq_lens.is_contiguous()
    G = Hq // Hkv
    if block_n is None:
        block_n = 32 if D > 128 else 64  # bounds registers for the K and V tiles
    if num_splits is None:
        num_splits = _default_num_splits(B, Hkv, block_tables.shape[1] * block_size, q.device)
    mid_o = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse,
        scale * 1.4426950408889634, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, UPCAST=_INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    _decode_reduce_kernel[(B, Hq)](
        mid_o, mid_lse, out, num_splits, out.stride(0), out.stride(1),
        D=D, S_PAD=triton.next_power_of_2(num_splits), CHUNK=min(16, triton.next_power_of_2(num_splits)),
        num_warps=4,
    )
    return out


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, *, num_splits=None, out=None):
    """Decode attention, q [B, Hq, D] -> [B, Hq, D]. Triton on CUDA or under TRITON_INTERPRET=1."""
    if q.is_cuda or (_INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"):
        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                             num_splits=num_splits, out=out)
    res = paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return res if out is None else out.copy_(res)
