"""Key sketches: int4 quantisation of basis-projected keys, and scoring every cached token
through them. PyTorch reference + three Triton kernels (CUDA-core FMAs; tensor cores, sketch_score_dot: softmax;
integers, sketch_score_dp4a: sum and max) + one dispatch (sketch_score).

Sketch layout, paged like the KV cache so prefix blocks can be shared:
  sketch [num_blocks, block_size, Hkv, r // 2] uint8 — two signed int4 values per byte
         (low nibble = even dim, high nibble = odd dim, stored as v + 8, v in [-7, 7])
  scale  [num_blocks, block_size, Hkv] float16 — per token and head: max|x| / 7
Per query head g of KV head h: s_g[b, t] = (P_h^T q_g) . dequant(sketch[t, h]) (P_h: the key basis).
The G heads of a group (and the KV heads when the selection is shared, output head dim 1) combine by
`combine`: "sum" (linear in q, so callers may pass the group sum [B, Hkv, r] and pay one dot per KV
head), "max", or "softmax" (sum of per-head softmax probabilities: ranks by estimated attention mass).
-inf outside [sinks, seq_len - recent), the rows that are always attended anyway.
"""
import os

import torch

from sketchkv.ops.topk import radix_histograms

try:
    import triton
    import triton.language as tl
    from sketchkv.ops.quant_kv import _round_half_even
    from sketchkv.ops.topk import first_digit_histogram
except ImportError:
    triton = None


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., r] -> (packed uint8 [..., r // 2], scale fp16 [...])."""
    scale = x.abs().amax(-1).float().clamp_min(1e-8) / 7.0
    v = torch.round(x.float() / scale[..., None]).clamp_(-7, 7).to(torch.int16) + 8
    packed = (v[..., 0::2] | (v[..., 1::2] << 4)).to(torch.uint8)
    return packed, scale.to(torch.float16)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0xF).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    v = torch.stack([lo, hi], dim=-1).flatten(-2).float()
    return v * scale.float()[..., None]


def sketch_keys_ref(k: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New keys k [T, Hkv, D] -> their sketches: (k - mean) projected on the basis [Hkv, D, r], int4."""
    return quantize_int4(torch.einsum("thd,hdr->thr", k.float() - mean, basis))


def sketch_write(k, mean, basis, sketch, scale, slots) -> None:
    """Sketch the new keys k [T, Hkv, D] into the paged sketch [.., Hkv, r/2] / scale [.., Hkv] at the cache
    slots [T] (the KV cache's slot mapping). Decode-size batches (T <= 256) on CUDA: one kernel (projection in
    fp32, the same int4 rounding), otherwise torch (a prefill chunk: a matmul)."""
    Hkv, r = basis.shape[0], basis.shape[-1]
    T, _, D = k.shape
    DC = min(64, D)
    if (triton is not None and T <= 256 and (k.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and k.stride(2) == 1 and D % DC == 0 and DC & (DC - 1) == 0 and r & (r - 1) == 0
            and basis.is_contiguous() and mean.is_contiguous() and basis.dtype == mean.dtype == torch.float32):
        if T:
            _sketch_write_kernel[(T, Hkv)](k, mean, basis, sketch, scale, slots, k.stride(0), k.stride(1),
                                           HKV=Hkv, D=D, R=r, DC=DC, num_warps=2)
        return
    packed, sc = sketch_keys_ref(k, mean, basis)
    sketch.view(-1, Hkv, r // 2).index_copy_(0, slots, packed)
    scale.view(-1, Hkv).index_copy_(0, slots, sc)


if triton is not None:

    @triton.jit
    def _sketch_write_kernel(k_ptr, mean_ptr, basis_ptr, sk_ptr, sc_ptr, slots_ptr, stride_kt, stride_kh,
                             HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, DC: tl.constexpr):
        # program (token t, KV head h): p = (k - mean) @ basis[h] (fp32, DC dims at a time), then int4 as
        # quantize_int4: scale = max|p| / 7 (fp32, stored fp16), codes round(p / scale) (half to even)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        r = tl.arange(0, R)
        acc = tl.zeros([R], tl.float32)
        for d0 in tl.static_range(0, D, DC):
            d = d0 + tl.arange(0, DC)
            x = tl.load(k_ptr + t * stride_kt + h * stride_kh + d).to(tl.float32) - tl.load(mean_ptr + h * D + d)
            b = tl.load(basis_ptr + (h * D + d[:, None]) * R + r[None, :])
            acc += tl.sum(x[:, None] * b, 0)
        s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(acc), 0), 1e-8), 7.0)
        y = tl.math.div_rn(acc, s)
        fl = tl.floor(y)
        f = y - fl
        odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
        q = tl.minimum(tl.maximum(tl.where((f > 0.5) | ((f == 0.5) & odd), fl + 1.0, fl), -7.0), 7.0)
        lo, hi = tl.split(tl.reshape(q.to(tl.int32) + 8, (R // 2, 2)))
        slot = tl.load(slots_ptr + t).to(tl.int64)
        tl.store(sk_ptr + (slot * HKV + h) * (R // 2) + tl.arange(0, R // 2), (lo | (hi << 4)).to(tl.uint8))
        tl.store(sc_ptr + slot * HKV + h, s.to(tl.float16))


def project_queries_ref(qg: torch.Tensor, basis: torch.Tensor, sum_groups: bool) -> torch.Tensor:
    """Query heads grouped by KV head, qg [B, Hkv, G, D] (any float dtype), on the key basis [Hkv, D, r] ->
    qp [B, Hkv, G, r] fp32 (sum_groups: the group's sum, [B, Hkv, 1, r]: scores are linear in q)."""
    qg = qg.float()
    if sum_groups:
        qg = qg.sum(2, keepdim=True)
    return torch.einsum("bhgd,hdr->bhgr", qg, basis)


def project_queries(qg: torch.Tensor, basis: torch.Tensor, sum_groups: bool) -> torch.Tensor:
    """project_queries_ref in one Triton launch on CUDA (and under TRITON_INTERPRET=1) for decode-size groups
    (G <= 16): the fp32 cast, the permuted copy and the fp32 GEMM of the einsum were 3 launches and ~10 us per
    layer at batch 1 (H200 run 69). fp32 math in another summation order: equal up to fp32 rounding.
    Programs (sequence, KV head, RC basis columns): with one program per (sequence, KV head) the kernel took
    12.6 us per layer at batch 1 (4 programs, each reading its head's 64 KB of basis in a serial loop; run 70)."""
    B, Hkv, G, D = qg.shape
    r = basis.shape[-1]
    DC, RC = min(64, D), min(16, r)
    if (triton is None or not (qg.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or G > 16
            or qg.stride(3) != 1 or D % DC or DC & (DC - 1) or r & (r - 1) or not basis.is_contiguous()
            or basis.dtype != torch.float32):
        return project_queries_ref(qg, basis, sum_groups)
    GO = 1 if sum_groups else G
    out = torch.empty(B, Hkv, GO, r, dtype=torch.float32, device=qg.device)
    if B:
        _project_queries_kernel[(B, Hkv, r // RC)](qg, basis, out, qg.stride(0), qg.stride(1), qg.stride(2), G,
                                                   D=D, R=r, RC=RC, DC=DC, GP=max(2, triton.next_power_of_2(G)),
                                                   SUM=sum_groups, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _project_queries_kernel(q_ptr, basis_ptr, out_ptr, stride_qb, stride_qh, stride_qg, G,
                                D: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, DC: tl.constexpr,
                                GP: tl.constexpr, SUM: tl.constexpr):
        # program (sequence b, KV head h, basis columns r): its G query heads [GP, DC] at a time against basis
        # rows [DC, RC] (fp32 FMAs; tl.dot would round fp32 to tf32). SUM: the heads summed first (the
        # reference's order).
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        g = tl.arange(0, GP)
        r = tl.program_id(2) * RC + tl.arange(0, RC)
        gm = g < G
        acc = tl.zeros([GP, RC], tl.float32)
        acc1 = tl.zeros([RC], tl.float32)
        for d0 in tl.static_range(0, D, DC):
            d = d0 + tl.arange(0, DC)
            x = tl.load(q_ptr + b * stride_qb + h * stride_qh + g[:, None] * stride_qg + d[None, :],
                        mask=gm[:, None], other=0.0).to(tl.float32)                                 # [GP, DC]
            w = tl.load(basis_ptr + (h * D + d[:, None]) * R + r[None, :])                          # [DC, RC]
            if SUM:
                acc1 += tl.sum(tl.sum(x, 0)[:, None] * w, 0)
            else:
                acc += tl.sum(x[:, :, None] * w[None, :, :], 1)
        HKV = tl.num_programs(1)   # (out [B, Hkv, G or 1, R] contiguous)
        if SUM:
            tl.store(out_ptr + (b * HKV + h) * R + r, acc1)
        else:
            tl.store(out_ptr + ((b * HKV + h) * G + g[:, None]) * R + r[None, :], acc, mask=gm[:, None])


COMBINES = ("sum", "max", "softmax")
KERNELS = ("auto", "fma", "dot", "dp4a")   # sketch_score(kernel=...)


LSE_MIN_SAMPLES = 4096   # a sampled softmax normalizer never takes fewer positions of a sequence than this


def lse_sample_strides(seq_lens: torch.Tensor, max_stride: int, min_samples: int = LSE_MIN_SAMPLES) -> torch.Tensor:
    """Per sequence, the stride of its sampled softmax normalizer: min(max_stride, max(1, n // min_samples)), so a
    sequence keeps at least min_samples positions (shorter than 2 min_samples: every one, the exact normalizer);
    the scoring kernel computes the same from the sequence length (_sketch_score_dot_kernel, MODE 2)."""
    return (seq_lens.long() // min_samples).clamp(1, max(1, max_stride))


def softmax_combine(s: torch.Tensor, num_kv_heads: int, shared: bool, sm_scale: float,
                    strides: torch.Tensor | None = None) -> torch.Tensor:
    """Per-query-head scores s [B, Hq, T] (-inf = masked) -> log of the summed estimated attention
    probabilities, [B, 1 or Hkv, T]: each head's scores go through its own softmax over the candidates
    (temperature `sm_scale`, the attention scale), then add up over the heads of a KV group (and over
    the KV heads when shared). Ranks tokens by estimated attention mass, so a head with one sharp
    target is not drowned by another head's broad, large raw scores. Masked positions stay -inf.
    strides [B] (lse_sample_strides): each head's normalizer estimated from the positions t % stride == 0 of its
    row (times the stride; 0 where none of them is a candidate), what the one-pass GPU kernel computes."""
    B, Hq, T = s.shape
    s = s.float() * sm_scale
    if strides is not None:
        st = strides.to(s.device).view(B, 1, 1)
        sampled = torch.arange(T, device=s.device) % st == 0                            # [B, 1, T]
        lse = torch.logsumexp(s.masked_fill(~sampled, float("-inf")), -1, keepdim=True) + st.float().log()
    else:
        lse = torch.logsumexp(s, -1, keepdim=True)
    logp = s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    logp = logp.view(B, num_kv_heads, Hq // num_kv_heads, T)
    return torch.logsumexp(logp.flatten(1, 2), 1, keepdim=True) if shared else torch.logsumexp(logp, 2)


def _as_groups(qp: torch.Tensor) -> torch.Tensor:
    return qp.unsqueeze(2) if qp.dim() == 3 else qp


def sketch_score_ref(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                     shared: bool = True, combine: str = "sum", sm_scale: float = 1.0, lse_stride: int = 0,
                     lse_min_samples: int = LSE_MIN_SAMPLES) -> torch.Tensor:
    """qp [B, Hkv, G, r] projected query heads ([B, Hkv, r]: G = 1, e.g. the group sum) -> scores
    [B, 1 or Hkv, max_len] fp32, combining the G heads of a KV group (and the KV heads when shared) by
    `combine`: sum of scores, max of scores, or softmax (see softmax_combine; lse_stride > 1: its normalizers
    sampled, lse_sample_strides)."""
    qp = _as_groups(qp)
    B, Hkv, G, r = qp.shape
    bs = sketch.shape[1]
    per_q = torch.full((B, Hkv, G, max_len), float("-inf"), device=qp.device)
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = sinks, n - recent
        if hi <= lo:
            continue
        blocks = block_tables[b, : (n + bs - 1) // bs].long()
        s = dequantize_int4(sketch[blocks].flatten(0, 1)[:n], scale[blocks].flatten(0, 1)[:n])  # [n, Hkv, r]
        per_q[b, :, :, lo:hi] = torch.einsum("hgr,thr->hgt", qp[b].float(), s)[:, :, lo:hi]
    strides = lse_sample_strides(seq_lens, lse_stride, lse_min_samples) if lse_stride > 1 else None
    return combine_heads(per_q, shared, combine, sm_scale, strides)


def combine_heads(per_q: torch.Tensor, shared: bool, combine: str, sm_scale: float,
                  strides: torch.Tensor | None = None) -> torch.Tensor:
    """per_q [B, Hkv, G, N] scores of every query head (-inf = not a candidate) -> [B, 1 or Hkv, N]."""
    Hkv = per_q.shape[1]
    if combine == "softmax":
        return softmax_combine(per_q.flatten(1, 2), Hkv, shared, sm_scale, strides)
    if combine == "sum":
        per_head = per_q.sum(2)
        return per_head.sum(1, keepdim=True) if shared else per_head
    if combine == "max":
        per_head = per_q.amax(2)
        return per_head.amax(1, keepdim=True) if shared else per_head
    raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")


def exact_key_scores(q, k_cache, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                     shared: bool = True, combine: str = "sum", sm_scale: float = 1.0) -> torch.Tensor:
    """The oracle the sketch approximates: q [B, Hkv, G, D] against the full keys of the paged cache
    k_cache [num_blocks, block_size, Hkv, D] -> scores [B, 1 or Hkv, max_len], same candidates and
    combine as sketch_score. Reads every key (dense cost): for evaluating selection, not for speed."""
    B, Hkv, G, D = q.shape
    bs = k_cache.shape[1]
    nb = -(-max_len // bs)
    k = k_cache[block_tables[:, :nb].long().clamp_min(0)].flatten(1, 2)[:, :max_len]      # [B, max_len, Hkv, D]
    per_q = torch.einsum("bhgd,bthd->bhgt", q.float(), k.float())
    t = torch.arange(max_len, device=q.device)[None]
    n = seq_lens.long()[:, None]
    cand = (t >= sinks) & (t < n - recent)
    per_q = per_q.masked_fill(~cand[:, None, None], float("-inf"))
    return combine_heads(per_q, shared, combine, sm_scale)


if triton is not None:

    @triton.jit
    def _score_rows(sk_ptr, sc_ptr, bt_ptr, lens_ptr, sinks, recent, num_blocks, stride_skb, stride_scb, stride_btb,
                    HKV: tl.constexpr, H2: tl.constexpr, BS: tl.constexpr, TOK: tl.constexpr, stride=1):
        """This program's TOK token rows (program (sequence b, tile pid)): positions t, which are candidates
        (inside the sequence, outside sinks and the recent window), and each row's sketch bytes [HKV * H2]
        (contiguous) and scales through the block table. stride > 1: every stride-th position only (the sampled
        softmax normalizer's pass)."""
        b = tl.program_id(0)
        pid = tl.program_id(1)
        n = tl.load(lens_ptr + b)
        t = (pid * TOK + tl.arange(0, TOK)) * stride
        j = t // BS
        live = (j * BS < n) & (j < num_blocks)
        valid = live & (t >= sinks) & (t < n - recent)
        blk = tl.load(bt_ptr + b * stride_btb + j, mask=live, other=0).to(tl.int64)
        row_sk = sk_ptr + blk * stride_skb + (t % BS) * (HKV * H2)
        row_sc = sc_ptr + blk * stride_scb + (t % BS) * HKV
        return b, pid, t, valid, row_sk, row_sc

    @triton.jit
    def _sketch_score_kernel(qp_ptr, sk_ptr, sc_ptr, bt_ptr, lens_ptr, lse_ptr, out_ptr, y_ptr,
                             sinks, recent, max_len, num_blocks, qk_scale,
                             stride_qb, stride_qh, stride_qg, stride_skb, stride_scb, stride_btb,
                             stride_lb, stride_lp, stride_ob, stride_oh, stride_yb,
                             HKV: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, BPP: tl.constexpr,
                             G: tl.constexpr, GP: tl.constexpr, MODE: tl.constexpr, SHARED: tl.constexpr):
        # One program per (sequence, BPP consecutive KV blocks) = TOK token rows, one KV head at a time:
        # its [TOK, R/2] bytes load as 16-byte vectors and serve all G query heads of that KV head
        # (CUDA-core FMAs). Nibbles become floats without int-to-float conversions (a quarter-rate
        # instruction on Hopper; the version that converted ran at 45% of the HBM copy bandwidth, this one
        # at 51%, H200 run 17): OR-ing a nibble into the mantissa of 2^23 gives the float 2^23 + u exactly,
        # so subtracting 2^23 + 8 yields u - 8 = v. The high nibble is masked in place (16 u) and its q
        # pre-scaled by 1/16 (exact). With G = 6 query heads (softmax) this is 2x slower than the tensor-core
        # kernel (per-head dots and block reductions): `sketch_score(kernel="auto")` takes that one there.
        # MODE 0: sum over heads, 1: max, 2: softmax pass 1 (log2-sum-exp2 of this program's rows per
        # query head -> lse_ptr [B, programs, HKV * G]), 3: softmax pass 2 (lse_ptr [B, HKV * G] the
        # per-head totals; out = log sum_g exp(s_g * sm_scale - lse_g)). qk_scale = sm_scale * log2(e).
        # GP, y_ptr: unused (the dot kernel's padded group and stored head scores), kept for one launcher.
        b, pid, t, valid, row_sk, row_sc = _score_rows(sk_ptr, sc_ptr, bt_ptr, lens_ptr, sinks, recent, num_blocks,
                                                       stride_skb, stride_scb, stride_btb, HKV, R // 2, BS, BPP * BS)
        TOK: tl.constexpr = BPP * BS
        H2: tl.constexpr = R // 2
        k = tl.arange(0, H2)
        d = tl.arange(0, R)
        odd16 = tl.where((d & 1) == 1, 0.0625, 1.0)        # hi nibbles come as 16 v
        LN2: tl.constexpr = 0.6931471805599453
        acc = tl.full((TOK,), float("-inf") if MODE == 1 else 0.0, tl.float32)   # SHARED: over KV heads
        run_m = tl.full((TOK,), float("-inf"), tl.float32)                       # MODE 3: online lse
        run_l = tl.zeros((TOK,), tl.float32)
        for h in tl.static_range(HKV):
            packed = tl.load(row_sk[:, None] + h * H2 + k[None, :], mask=valid[:, None], other=0).to(tl.int32)
            lo = ((packed & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0    # v = u - 8
            hi = ((packed & 240) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0   # 16 v
            v = tl.reshape(tl.join(lo, hi), (TOK, R))    # dims back in order (register-local): q loads whole
            sc = tl.load(row_sc + h, mask=valid, other=0.0).to(tl.float32)
            hs = tl.full((TOK,), float("-inf") if MODE == 1 else 0.0, tl.float32)
            if MODE == 3 and not SHARED:
                run_m = tl.full((TOK,), float("-inf"), tl.float32)
                run_l = tl.zeros((TOK,), tl.float32)
            for g in tl.static_range(G):
                q = tl.load(qp_ptr + b * stride_qb + h * stride_qh + g * stride_qg + d).to(tl.float32) * odd16
                s = tl.sum(v * q[None, :], axis=1) * sc                                 # [TOK]
                if MODE == 0:
                    hs = hs + s
                elif MODE == 1:
                    hs = tl.maximum(hs, s)
                elif MODE == 2:
                    x = tl.where(valid, s * qk_scale, float("-inf"))
                    m = tl.max(x, axis=0)
                    m = tl.where(m == float("-inf"), 0.0, m)     # no valid row: l = 0 -> -inf, not nan
                    part = m + tl.log2(tl.sum(tl.exp2(x - m), axis=0))
                    tl.store(lse_ptr + b * stride_lb + pid * stride_lp + h * G + g, part)
                else:  # running log2-sum-exp2 over the heads combined, max-shifted (no underflow to -inf)
                    lse = tl.load(lse_ptr + b * stride_lb + h * G + g)
                    y = tl.where(valid, s * qk_scale - lse, float("-inf"))
                    m_new = tl.maximum(run_m, y)
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    run_l = run_l * tl.exp2(run_m - m_safe) + tl.exp2(y - m_safe)
                    run_m = m_new
            if MODE == 0 or MODE == 1:
                if SHARED:
                    acc = acc + hs if MODE == 0 else tl.maximum(acc, hs)
                else:
                    tl.store(out_ptr + b * stride_ob + h * stride_oh + t, tl.where(valid, hs, float("-inf")),
                             mask=t < max_len)
            elif MODE == 3 and not SHARED:
                o = (run_m + tl.log2(run_l)) * LN2
                tl.store(out_ptr + b * stride_ob + h * stride_oh + t, tl.where(valid, o, float("-inf")),
                         mask=t < max_len)
        if SHARED and MODE != 2:
            if MODE == 3:
                acc = (run_m + tl.log2(run_l)) * LN2
            tl.store(out_ptr + b * stride_ob + t, tl.where(valid, acc, float("-inf")), mask=t < max_len)


SOFTMAX_SCRATCH_BYTES = 128 << 20   # stored head scores of one launch; larger batches go in groups of rows


def _launch_score(kernel, qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared, combine,
                  sm_scale, bpp, num_warps, gp, store_heads: bool = False, scratch_bytes: int = SOFTMAX_SCRATCH_BYTES,
                  rank: int | None = None, radix_hist: torch.Tensor | None = None, lse_stride: int = 0,
                  lse_min_samples: int = LSE_MIN_SAMPLES, **consts):
    """Shared launcher of the scoring kernels (same arguments and modes). softmax, two passes over the
    sketch: pass 1 (per-program partial log-sum-exp per query head; torch combines them over programs), then
    pass 2: the sketch scored again. softmax with store_heads (dot kernel): the sketch scored once, every head's
    score stored in fp16 ([rows, Hq, max_len]: 48 B per token at 24 heads, against the 136 B of sketch and
    scales a second scoring pass reads), then each head's total (_head_lse_kernel per chunk of tokens,
    _lse_finish_kernel) and _softmax_combine_kernel; rows go in groups whose scores fit in `scratch_bytes`
    (8 x 256K tokens x 24 heads: 98 MB, one group). rank: the sketch's, when qp holds something else per query
    head (the dp4a kernel's words). radix_hist ([4, rows of out, 256] int32, any contents): filled for
    topk_positions(hist=...): the first radix round of the scores counted, rounds 1-3 zero; with stored head scores
    _lse_finish_kernel zeroes it and _softmax_combine_kernel counts as it writes (top-k's memset and first pass
    gone), otherwise radix_histograms' first round runs after the scores. lse_stride > 1 (softmax, dot kernel): each
    head's normalizer estimated from every st-th position of its sequence (st: lse_sample_strides; MODE 2 over those
    rows, _lse_finish_kernel), then one scoring pass that combines as it scores (MODE 3, counting top-k's first
    round): nothing stored."""
    B, Hkv, G, r = qp.shape
    r = rank or r
    bs = sketch.shape[1]
    # each block's rows must be one contiguous [bs, Hkv * r/2] tile (how the runner allocates them)
    assert sketch.stride(1) == Hkv * (r // 2) and sketch.stride(2) == r // 2 and sketch.stride(3) == 1
    assert scale.stride(1) == Hkv and scale.stride(2) == 1
    nblk = triton.cdiv(max_len, bs)
    programs = triton.cdiv(nblk, bpp)
    out = torch.empty(B, 1 if shared else Hkv, max_len, dtype=torch.float32, device=qp.device)
    qk_scale = sm_scale * 1.4426950408889634
    sampled_lse = combine == "softmax" and lse_stride > 1   # one pass: no stored head scores (no y scratch)
    store = combine == "softmax" and store_heads and not sampled_lse
    if radix_hist is not None:
        assert radix_hist.shape == (4, out.shape[0] * out.shape[1], 256) and radix_hist.is_contiguous()
    Hq = Hkv * G
    group = max(1, min(B, scratch_bytes // (max_len * Hq * 2))) if store else B
    y = torch.empty(group, Hq, max_len, dtype=torch.float16, device=qp.device) if store else out

    def launch(rows, mode, lse, stride_lb, stride_lp, grid=programs, **extra):
        kernel[(rows.stop - rows.start, grid)](
            qp[rows], sketch, scale, block_tables[rows], seq_lens[rows], lse, out[rows], y, sinks, recent, max_len,
            min(nblk, block_tables.shape[1]), qk_scale, qp.stride(0), qp.stride(1), qp.stride(2), sketch.stride(0),
            scale.stride(0), block_tables.stride(0), stride_lb, stride_lp, out.stride(0), out.stride(1), y.stride(0),
            HKV=Hkv, R=r, BS=bs, BPP=bpp, G=G, GP=gp, MODE=mode, SHARED=shared, num_warps=num_warps, **consts,
            **extra)

    if combine != "softmax":
        launch(slice(0, B), COMBINES.index(combine), out, 0, 0)
        return _first_round(out, radix_hist)
    if sampled_lse:
        assert kernel is _sketch_score_dot_kernel
        # programs of the sampled pass: a sequence samples at most max_len / lse_stride positions, or (a stride
        # n // lse_min_samples below lse_stride) fewer than 2 lse_min_samples
        positions = min(max_len, max(triton.cdiv(max_len, lse_stride), 2 * lse_min_samples))
        sampled = triton.cdiv(positions, bpp * bs)
        part = torch.empty(sampled, B, Hq, dtype=torch.float32, device=qp.device)   # [program, row, head]
        launch(slice(0, B), 2, part, part.stride(1), part.stride(0), grid=sampled, SAMPLED=True,
               lse_max_stride=lse_stride, lse_min_samples=lse_min_samples)
        lse = torch.empty(B, Hq, dtype=torch.float32, device=qp.device)
        rows = out.shape[0] * out.shape[1]
        _lse_finish_kernel[(B * Hq,)](part, lse, sampled, 1, B * Hq, out if radix_hist is None else radix_hist,
                                      rows, 0, rows,
                                      NCHP=max(16, triton.next_power_of_2(sampled)), HIST=radix_hist is not None,
                                      num_warps=1)
        launch(slice(0, B), 3, lse, lse.stride(0), 0, HIST=radix_hist is not None, hist_ptr=radix_hist)
        return out
    if store:
        nch = triton.cdiv(max_len, LSE_CHUNK)
        part = torch.empty(group, Hq, nch, dtype=torch.float32, device=qp.device)
        lse = torch.empty(group, Hq, dtype=torch.float32, device=qp.device)
        hist = out if radix_hist is None else radix_hist   # (out: an unused pointer)
        per_b = out.shape[1]   # hist rows per sequence: 1 (shared) or Hkv
        for b0 in range(0, B, group):
            rows = slice(b0, min(B, b0 + group))
            n = rows.stop - rows.start
            launch(rows, 4, out, 0, 0)
            _head_lse_kernel[(n, Hq, nch)](y, part, max_len, y.stride(0), nch, CHUNK=LSE_CHUNK, num_warps=4)
            _lse_finish_kernel[(n * Hq,)](part, lse, nch, nch, 1, hist, B * per_b, b0 * per_b, n * per_b,
                                          NCHP=max(16, triton.next_power_of_2(nch)), HIST=radix_hist is not None,
                                          num_warps=1)
            o = out[rows]
            _softmax_combine_kernel[(n, triton.cdiv(max_len, COMBINE_TOKENS))](
                y, lse, o, hist, b0 * per_b, max_len, y.stride(0), o.stride(0), o.stride(1), HKV=Hkv, G=G,
                TOK=COMBINE_TOKENS, SHARED=shared, HIST=radix_hist is not None, num_warps=4)
        return out
    part = torch.empty(B, programs, Hq, dtype=torch.float32, device=qp.device)
    launch(slice(0, B), 2, part, part.stride(0), part.stride(1))
    lse = torch.logsumexp(part * 0.6931471805599453, 1) * 1.4426950408889634     # [B, Hq], base 2
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).contiguous()   # no candidate: stays -inf
    launch(slice(0, B), 3, lse, lse.stride(0), 0)
    return _first_round(out, radix_hist)


def _first_round(out: torch.Tensor, radix_hist: torch.Tensor | None) -> torch.Tensor:
    """A scoring path that does not count top-k's first radix round itself: radix_histograms' first pass."""
    if radix_hist is not None:
        radix_hist.zero_()
        radix_histograms(out.view(-1, out.shape[-1]), 1, radix_hist, rounds=(0,))
    return out


def sketch_score_triton(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                        shared: bool = True, combine: str = "sum", sm_scale: float = 1.0, bpp: int = 1,
                        num_warps: int = 2, radix_hist: torch.Tensor | None = None) -> torch.Tensor:
    """sketch_score on CUDA cores (fp32 FMAs); same meaning as sketch_score_ref up to fp32 rounding.
    bpp (blocks per program) and num_warps: swept on an H200 by benchmarks/bench_sparse_ops.py."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    qp = _as_groups(qp).contiguous()
    assert (qp.shape[-1] // 2) & (qp.shape[-1] // 2 - 1) == 0, "rank / 2 must be a power of two"
    return _launch_score(_sketch_score_kernel, qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len,
                         shared, combine, sm_scale, bpp, num_warps, 1, radix_hist=radix_hist)


def quantize_query_int8(qp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Projected query heads qp [..., r] -> (codes int32 [..., r] in [-127, 127], scale fp32 [...]): per head,
    scale = max|q| / 127 (at least 2^-126 / 127: an all-zero head scores 0), codes round(q / scale) half to
    even. What sketch_score_dp4a scores with: q^ = codes * scale, |q - q^| <= scale / 2 per element."""
    q = qp.float()
    m = q.abs().amax(-1).clamp_min(2.0 ** -126)
    # a tensor divisor, not the Python float: on CUDA, torch multiplies by the reciprocal of a scalar divisor, which
    # rounds differently from the kernel's IEEE division (H200 run 85: words that differed from the kernel's)
    scale = m / torch.full_like(m, 127.0)
    return torch.round(q / scale[..., None]).clamp_(-127, 127).to(torch.int32), scale


def query_words_ref(qp: torch.Tensor) -> torch.Tensor:
    """qp [..., r] -> int32 [..., r/4 + 2], what the dp4a kernel reads per query head: the int8 codes of
    quantize_query_int8 packed 4 per word (byte i of word j = code 4j + i), the even dims' r/8 words, then the
    odd dims' r/8, then the codes' sum, then the scale's fp32 bits."""
    codes, scale = quantize_query_int8(qp)
    shift = torch.arange(4, device=qp.device, dtype=torch.int32) * 8

    def words(c):   # [..., r/2] -> [..., r/8]; disjoint bits: the sum is an OR (int32 wraps like the kernel)
        return ((c.unflatten(-1, (-1, 4)) & 255) << shift).sum(-1, dtype=torch.int32)

    return torch.cat([words(codes[..., 0::2]), words(codes[..., 1::2]), codes.sum(-1, dtype=torch.int32)[..., None],
                      scale.view(torch.int32)[..., None]], -1)


def query_words(qp: torch.Tensor) -> torch.Tensor:
    """query_words_ref in one Triton launch (one program per query head), made once per scoring call: when every
    scoring program quantised its own query heads, that was the dp4a kernel's top stall (ncu, H200 run 83)."""
    if triton is None or not (qp.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return query_words_ref(qp)
    qp = qp.float().contiguous()
    r = qp.shape[-1]
    out = torch.empty(*qp.shape[:-1], r // 4 + 2, dtype=torch.int32, device=qp.device)
    n = qp.numel() // r
    if n:
        _query_words_kernel[(n,)](qp, out, R=r, num_warps=1)
    return out


def sketch_score_dp4a(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                      shared: bool = True, combine: str = "sum", sm_scale: float = 1.0, bpp: int = 1,
                      num_warps: int = 4, unpack: str = "auto", radix_hist: torch.Tensor | None = None) -> torch.Tensor:
    """Scoring in integers: each query head quantised to int8 (query_words: once per call, one small
    launch), every 4 sketch bytes (8 nibbles) against it in two dp4a instructions (4 byte products summed into an
    int32 each), exact; the score is (sum_r q8_r u_r - 8 sum_r q8_r) * scale_t * scale_q with u = v + 8 the stored
    nibble. The fp32 CUDA-core kernel spends ~8 instructions per sketch byte (it issues at 75% of the SMs' peak
    with DRAM at 47%: instruction-bound, H200 run 81); this one ~1.5. One 27B layer at 8 x 250K on an H200, replayed
    from a CUDA graph (run 87, benchmarks/bench_sketch_score.py): sum 78 us, **79% of the copy bandwidth** (fma
    119, 51%; ncu: 69 us, DRAM 79%), max 159 us (every query head: 6 dots per row; fma 311). Earlier versions made
    the codes in every program (102 us, its top stall; runs 83-84) or looped over the KV heads (96 us; run 87).
    Tiles: bpp 1-2 x 2-4 warps within 6% of each other for sum, larger ones slower (run 87).
    Same meaning as sketch_score_ref on the dequantised query codes * scale, up to fp32 rounding. unpack: "asm"
    (PTX dp4a on int32 words, CUDA only), "ops" (the same integers with Triton ops: the interpreter's path),
    "auto" = asm on CUDA. softmax: every head's score stored in fp16 and finished by the dot kernel's passes
    (per-head totals, combine; see _launch_score): 254 us against the dot kernel's 242 (H200 run 92: the stored
    head scores and the extra passes cost what the integers save), so auto keeps the dot kernel for it."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if unpack not in ("auto", "asm", "ops"):
        raise ValueError(f"unpack must be auto, asm or ops, got {unpack!r}")
    qp = _as_groups(qp)
    assert qp.shape[-1] % 8 == 0 and (qp.shape[-1] // 2) & (qp.shape[-1] // 2 - 1) == 0, \
        "rank must be a multiple of 8 with rank / 2 a power of two (4-byte words)"
    # the kernel reads each query head's words through the query's batch / KV head / group strides; R = the rank
    return _launch_score(_sketch_score_dp4a_kernel, query_words(qp), sketch, scale, block_tables, seq_lens, sinks,
                         recent, max_len, shared, combine, sm_scale, bpp, num_warps, 1, store_heads=True,
                         rank=qp.shape[-1], radix_hist=radix_hist, HKVP=triton.next_power_of_2(qp.shape[1]),
                         ASM=unpack == "asm" or (unpack == "auto" and qp.is_cuda
                                                 and isinstance(_sketch_score_dp4a_kernel, triton.runtime.JITFunction)))


if triton is not None:

    @triton.jit
    def _query_words_kernel(q_ptr, out_ptr, R: tl.constexpr):
        # one query head [R] fp32 -> its int8 codes (IEEE division, round half to even: quantize_query_int8's
        # integers) packed as query_words_ref's [R/4 + 2] int32
        i = tl.program_id(0).to(tl.int64)
        W: tl.constexpr = R // 8
        q = tl.load(q_ptr + i * R + tl.arange(0, R))
        qs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(q), 0), 1.1754943508222875e-38), 127.0)
        c = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(q, qs)), -127.0), 127.0).to(tl.int32)
        ce, co = tl.split(tl.reshape(c, (R // 2, 2)))
        shift = tl.arange(0, 4) * 8
        row = out_ptr + i * (2 * W + 2)
        tl.store(row + tl.arange(0, W), tl.sum((tl.reshape(ce, (W, 4)) & 255) << shift[None, :], 1))
        tl.store(row + W + tl.arange(0, W), tl.sum((tl.reshape(co, (W, 4)) & 255) << shift[None, :], 1))
        tl.store(row + 2 * W, tl.sum(c, 0))
        tl.store(row + 2 * W + 1, qs.to(tl.int32, bitcast=True))

    @triton.jit
    def _sketch_score_dp4a_kernel(qp_ptr, sk_ptr, sc_ptr, bt_ptr, lens_ptr, lse_ptr, out_ptr, y_ptr,
                                  sinks, recent, max_len, num_blocks, qk_scale,
                                  stride_qb, stride_qh, stride_qg, stride_skb, stride_scb, stride_btb,
                                  stride_lb, stride_lp, stride_ob, stride_oh, stride_yb,
                                  HKV: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, BPP: tl.constexpr,
                                  G: tl.constexpr, GP: tl.constexpr, MODE: tl.constexpr, SHARED: tl.constexpr,
                                  HKVP: tl.constexpr = 1, ASM: tl.constexpr = False):
        # One program per (sequence, BPP consecutive KV blocks) = TOK tokens, as ROWS = TOK x HKVP rows (token, KV
        # head; HKVP = HKV rounded up to a power of two, the padding rows masked): a token's KV heads are
        # consecutive in the sketch and in the scales, so each block's bytes load as one contiguous run and every
        # row's query words come from L1 (query_words: R/4 + 2 int32 per head).
        # Looping over the KV heads with [TOK] vectors instead moved each head's pointers and scores through shared
        # memory (Triton layout conversions): 96 against 78 us per 27B layer (H200 run 87). MODE 0: sum over
        # heads, 1: max, 4: softmax's stored head scores (y_ptr, qk_scale; the launcher's modes). ASM: a row's R/2
        # bytes load as R/8 int32 words; per word the low nibbles (even dims) and the high ones (odd dims) are
        # masked in place and each dp4a'd against 4 codes of the matching dims. Otherwise: the same integers, byte
        # by byte.
        H2: tl.constexpr = R // 2
        W: tl.constexpr = R // 8
        TOK: tl.constexpr = BPP * BS
        ROWS: tl.constexpr = TOK * HKVP
        b = tl.program_id(0)
        pid = tl.program_id(1)
        n = tl.load(lens_ptr + b)
        rr = tl.arange(0, ROWS)
        hh = rr % HKVP
        real = hh < HKV
        hq = tl.minimum(hh, HKV - 1)   # a padding row reads a real head's query words (in bounds, unused)
        t = pid * TOK + rr // HKVP
        j = t // BS
        live = (j * BS < n) & (j < num_blocks)
        valid = live & (t >= sinks) & (t < n - recent)
        ld = valid & real
        blk = tl.load(bt_ptr + b * stride_btb + j, mask=live, other=0).to(tl.int64)
        row_sk = sk_ptr + blk * stride_skb + ((t % BS) * HKV + hh) * H2
        sc = tl.load(sc_ptr + blk * stride_scb + (t % BS) * HKV + hh, mask=ld, other=0.0).to(tl.float32)
        if ASM:
            words = tl.load(row_sk.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, W)[None, :],
                            mask=ld[:, None], other=0)                                          # [ROWS, W]
        else:
            packed = tl.load(row_sk[:, None] + tl.arange(0, H2)[None, :], mask=ld[:, None],
                             other=0).to(tl.int32)                                              # [ROWS, H2]
            lo = packed & 15
            hi = packed >> 4
        hs = tl.full((ROWS,), float("-inf") if MODE == 1 else 0.0, tl.float32)
        for g in tl.static_range(G):
            qrow = qp_ptr + b * stride_qb + hq * stride_qh + g * stride_qg                      # [ROWS]
            csum = tl.load(qrow + 2 * W)
            qs = tl.load(qrow + 2 * W + 1).to(tl.float32, bitcast=True)
            we = tl.load(qrow[:, None] + tl.arange(0, W)[None, :])           # [ROWS, W]: even dims' codes
            wo = tl.load(qrow[:, None] + W + tl.arange(0, W)[None, :])       # odd dims'
            if ASM:
                d = tl.inline_asm_elementwise(
                    "{ .reg .b32 a, b; and.b32 a, $1, 0x0F0F0F0F; shr.u32 b, $1, 4; and.b32 b, b, 0x0F0F0F0F; "
                    "dp4a.u32.s32 $0, a, $2, 0; dp4a.u32.s32 $0, b, $3, $0; }",
                    "=r,r,r,r", [words, we, wo], dtype=tl.int32, is_pure=True, pack=1)
                dots = tl.sum(d, 1)
            else:
                up = (24 - tl.arange(0, 4) * 8)[None, None, :]   # the words' signed bytes back as codes
                ce = tl.reshape((we[:, :, None] << up) >> 24, (ROWS, H2))
                co = tl.reshape((wo[:, :, None] << up) >> 24, (ROWS, H2))
                dots = tl.sum(lo * ce + hi * co, 1)
            s = (dots - 8 * csum).to(tl.float32) * (sc * qs)
            if MODE == 4:   # softmax: the head's score in log2 units, fp16, head-major, as the dot kernel's MODE 4
                x = tl.minimum(tl.where(valid, s * qk_scale, float("-inf")), 65000.0)
                tl.store(y_ptr + b.to(tl.int64) * stride_yb + (hq * G + g) * max_len + t, x.to(tl.float16),
                         mask=(t < max_len) & real)
            else:
                hs = hs + s if MODE == 0 else tl.maximum(hs, s)
        if MODE != 4:
            hs = tl.where(valid, hs, float("-inf"))
            if SHARED:   # padding rows add nothing (a token's rows are all valid or all not)
                h2 = tl.reshape(tl.where(real, hs, 0.0 if MODE == 0 else float("-inf")), (TOK, HKVP))
                acc = tl.sum(h2, 1) if MODE == 0 else tl.max(h2, 1)
                tt = pid * TOK + tl.arange(0, TOK)
                tl.store(out_ptr + b * stride_ob + tt, acc, mask=tt < max_len)
            else:
                tl.store(out_ptr + b * stride_ob + hh * stride_oh + t, hs, mask=(t < max_len) & real)


if triton is not None:

    @triton.jit
    def _int4_to_fp16(packed, ASM: tl.constexpr):
        """uint8 [..., R/2] (two int4 per byte, each stored as v + 8) -> (lo, hi) fp16 [..., R/2]: the values v of
        the low and the high nibbles, exactly, without int-to-float conversions: 0x6400 | u is the fp16 1024 + u,
        so minus 1032 gives u - 8 = v (in [-7, 7]: exact in fp16).
        ASM (CUDA): per 4 bytes, the nibbles masked in place (and, shr + and), each pair of bytes moved under
        0x64 high bytes by one prmt, 1032 subtracted two at a time: ~3 instructions per byte. The same
        arithmetic in Triton ops widens every byte to 32 bits first: ~7 per byte, half of the softmax scoring
        pass's instructions (ncu, H200 run 47: it issues at 64% of the SMs' peak, DRAM at 35%).
        The interpreter cannot run PTX: it takes the Triton ops."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 a, b, c; and.b32 a, $4, 0x0F0F0F0F; shr.b32 b, $4, 4; and.b32 b, b, 0x0F0F0F0F; "
                "mov.b32 c, 0x64086408; "
                "prmt.b32 $0, a, 0x64646464, 0x4140; prmt.b32 $1, a, 0x64646464, 0x4342; "
                "prmt.b32 $2, b, 0x64646464, 0x4140; prmt.b32 $3, b, 0x64646464, 0x4342; "
                "sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; sub.f16x2 $2, $2, c; sub.f16x2 $3, $3, c; }",
                "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        p = packed.to(tl.int32)
        lo = ((p & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        hi = ((p >> 4) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        return lo, hi

    @triton.jit
    def _sketch_score_dot_kernel(qp_ptr, sk_ptr, sc_ptr, bt_ptr, lens_ptr, lse_ptr, out_ptr, y_ptr,
                                 sinks, recent, max_len, num_blocks, qk_scale,
                                 stride_qb, stride_qh, stride_qg, stride_skb, stride_scb, stride_btb,
                                 stride_lb, stride_lp, stride_ob, stride_oh, stride_yb,
                                 HKV: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, BPP: tl.constexpr,
                                 G: tl.constexpr, GP: tl.constexpr, MODE: tl.constexpr, SHARED: tl.constexpr,
                                 ASM: tl.constexpr = False, SAMPLED: tl.constexpr = False, lse_max_stride=1,
                                 lse_min_samples=1, HIST: tl.constexpr = False, hist_ptr=None):
        # One program per (sequence, BPP consecutive KV blocks) = TOK token rows. Per KV head h the
        # scores of its G query heads are a [TOK, R] @ [R, G] matmul on tensor cores, split by nibble:
        # lo [TOK, R/2] @ q_even [R/2, GP] + hi @ q_odd, G padded to GP >= 16 with zero query columns.
        # MODE 0: sum over heads, 1: max, 2: softmax pass 1 (log2-sum-exp2 of this program's rows per
        # query head -> lse_ptr [B, programs, HKV * G]), 3: softmax pass 2 (lse_ptr [B, HKV * G] the per-head
        # totals; out = log sum_g exp(s_g * sm_scale - lse_g)), 4: softmax pass 1 storing every head's score
        # (-> y_ptr; _head_lse_kernel and _softmax_combine_kernel finish). qk_scale = sm_scale * log2(e).
        # SAMPLED (MODE 2): the sampled normalizer's pass, every st-th position of the sequence (st as
        # lse_sample_strides), each partial + log2 st. HIST (MODE 3): top-k's first radix round of the scores written,
        # counted into hist_ptr [4, rows of out, 256] (round 0 first).
        st = 1
        if SAMPLED:
            st = tl.minimum(tl.maximum(tl.load(lens_ptr + tl.program_id(0)) // lse_min_samples, 1), lse_max_stride)
        b, pid, t, valid, row_sk, row_sc = _score_rows(sk_ptr, sc_ptr, bt_ptr, lens_ptr, sinks, recent, num_blocks,
                                                       stride_skb, stride_scb, stride_btb, HKV, R // 2, BS, BPP * BS,
                                                       st)
        TOK: tl.constexpr = BPP * BS
        H2: tl.constexpr = R // 2
        k = tl.arange(0, H2)
        gs = tl.arange(0, GP)
        gmask = gs < G
        q_even = qp_ptr + b * stride_qb + gs[None, :] * stride_qg + 2 * k[:, None]   # [R/2, GP]
        LN2: tl.constexpr = 0.6931471805599453
        acc = tl.full((TOK,), float("-inf") if MODE == 1 else 0.0, tl.float32)   # SHARED: over KV heads
        run_m = tl.full((TOK,), float("-inf"), tl.float32)                       # MODE 3 SHARED: online lse
        run_l = tl.zeros((TOK,), tl.float32)
        for h in tl.static_range(HKV):
            packed = tl.load(row_sk[:, None] + h * H2 + k[None, :], mask=valid[:, None], other=0)
            # Tried and slower at 8 x 250K (softmax scoring pass, 199 us per layer with the Triton-op unpacking):
            # int8 operands, the nibbles as they are with q quantised per head (225 us, H200 run 42); every KV
            # head in one [HKV, TOK, R/2] load and batched dot (289 us, run 43); 4-16 tiles per program in a loop
            # software-pipelined by tl.range(num_stages=2-4) (cp.async into shared memory: 563 us against 245 for
            # one tile per program, run 75; the fma kernel's sum mode 135 vs 119).
            lo, hi = _int4_to_fp16(packed, ASM)
            # q in fp16: relative rounding error <= 2^-11 per element, so a score is off by at most
            # 2^-11 * sum_r |k_r q_r| (~1e-3 relative) -- far below the int4 sketch's own error, and only
            # reorders near-ties at the top-k boundary. Products are exact, accumulation is fp32.
            qe = tl.load(q_even + h * stride_qh, mask=gmask[None, :], other=0.0).to(tl.float16)
            qo = tl.load(q_even + h * stride_qh + 1, mask=gmask[None, :], other=0.0).to(tl.float16)
            s = tl.dot(lo, qe, out_dtype=tl.float32)
            s = tl.dot(hi, qo, s)
            sc = tl.load(row_sc + h, mask=valid, other=0.0).to(tl.float32)
            if MODE != 4:
                s = s * sc[:, None]                                              # [TOK, GP]
            if MODE == 0 or MODE == 1:
                # padded columns: q = 0 -> s = 0, neutral for the sum; excluded from the max
                hs = tl.sum(s, axis=1) if MODE == 0 else tl.max(tl.where(gmask[None, :], s, float("-inf")), axis=1)
                if SHARED:
                    acc = acc + hs if MODE == 0 else tl.maximum(acc, hs)
                else:
                    tl.store(out_ptr + b * stride_ob + h * stride_oh + t, tl.where(valid, hs, float("-inf")),
                             mask=t < max_len)
            elif MODE == 2:
                x = tl.where(valid[:, None], s * qk_scale, float("-inf"))
                m = tl.max(x, axis=0)
                m = tl.where(m == float("-inf"), 0.0, m)     # no valid row: l = 0 -> -inf, not nan
                part = m + tl.log2(tl.sum(tl.exp2(x - m[None, :]), axis=0))
                if SAMPLED:
                    part += tl.log2(st.to(tl.float32))
                tl.store(lse_ptr + b * stride_lb + pid * stride_lp + h * G + gs, part, mask=gmask)
            elif MODE == 4:
                # every head's score in log2 units, fp16, head-major (y [rows, HKV * G, max_len]); no reduction
                # over the tile's rows here: those per-head column reductions made MODE 2 3x slower than MODE 0
                # (H200 run 29: 490 vs 161 us per layer at 8 x 250K). fp16 holds |x| <= 65504 (clamped above).
                x = tl.minimum(tl.where(valid[:, None], s * (sc * qk_scale)[:, None], float("-inf")), 65000.0)
                tl.store(y_ptr + b.to(tl.int64) * stride_yb + (h * G + gs[None, :]) * max_len + t[:, None],
                         x.to(tl.float16), mask=(t < max_len)[:, None] & gmask[None, :])
            else:
                lse = tl.load(lse_ptr + b * stride_lb + h * G + gs, mask=gmask, other=0.0)
                y = tl.where(valid[:, None] & gmask[None, :], s * qk_scale - lse[None, :], float("-inf"))
                if SHARED:  # running log2-sum-exp2 over the KV heads, max-shifted (no underflow to -inf)
                    m_new = tl.maximum(run_m, tl.max(y, axis=1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    run_l = run_l * tl.exp2(run_m - m_safe) + tl.sum(tl.exp2(y - m_safe[:, None]), axis=1)
                    run_m = m_new
                else:
                    m = tl.max(y, axis=1)
                    m = tl.where(m == float("-inf"), 0.0, m)
                    o = tl.where(valid, (m + tl.log2(tl.sum(tl.exp2(y - m[:, None]), axis=1))) * LN2, float("-inf"))
                    tl.store(out_ptr + b * stride_ob + h * stride_oh + t, o, mask=t < max_len)
                    if HIST:
                        cnt = first_digit_histogram(o, t < max_len)
                        tl.atomic_add(hist_ptr + (b * HKV + h) * 256 + tl.arange(0, 256), cnt, mask=cnt > 0)
        if SHARED and MODE != 2 and MODE != 4:
            if MODE == 3:
                acc = (run_m + tl.log2(run_l)) * LN2
            o = tl.where(valid, acc, float("-inf"))
            tl.store(out_ptr + b * stride_ob + t, o, mask=t < max_len)
            if HIST:
                cnt = first_digit_histogram(o, t < max_len)
                tl.atomic_add(hist_ptr + b * 256 + tl.arange(0, 256), cnt, mask=cnt > 0)


if triton is not None:

    @triton.jit
    def _head_lse_kernel(y_ptr, part_ptr, max_len, stride_yb, nch, CHUNK: tl.constexpr):
        # part [rows, Hq, nch]: log2-sum-exp2 of one head's stored scores over one CHUNK of tokens (in registers)
        b = tl.program_id(0)
        j = tl.program_id(1)
        c = tl.program_id(2)
        t = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(y_ptr + b.to(tl.int64) * stride_yb + j * max_len + t, mask=t < max_len,
                    other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)            # no candidate: log2(0) = -inf, not nan
        tl.store(part_ptr + (b * tl.num_programs(1) + j) * nch + c, m + tl.log2(tl.sum(tl.exp2(x - m), axis=0)))

    @triton.jit
    def _lse_finish_kernel(part_ptr, lse_ptr, nch, stride_pi, stride_pc, hist_ptr, hist_rows, hist_row0, hist_n,
                           NCHP: tl.constexpr, HIST: tl.constexpr):
        # lse [rows * Hq]: the chunks' log2-sums (part [i * stride_pi + c * stride_pc]) combined; 0 for a head
        # without candidates (its y stays -inf).
        # HIST: also zero this launch's rows [hist_row0, + hist_n) of all 4 rounds of top-k's histograms
        # hist [4, hist_rows, 256] (the combining kernel counts round 0 into them next; top-k adds rounds 1-3)
        i = tl.program_id(0)
        if HIST:
            z = tl.zeros((256,), tl.int32)
            for j in range(i, 4 * hist_n, tl.num_programs(0)):
                row = (j // hist_n) * hist_rows + hist_row0 + j % hist_n
                tl.store(hist_ptr + row * 256 + tl.arange(0, 256), z)
        c = tl.arange(0, NCHP)
        p = tl.load(part_ptr + i * stride_pi + c * stride_pc, mask=c < nch, other=float("-inf"))
        m = tl.max(p, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        tot = tl.sum(tl.exp2(p - m), axis=0)
        tl.store(lse_ptr + i, tl.where(tot > 0, m + tl.log2(tot), 0.0))

    @triton.jit
    def _head_log_mass(row, lse_b, j, max_len, tm):
        # head j's stored scores for this program's tokens minus the head's total (log2 units)
        return tl.load(row + j * max_len, mask=tm, other=float("-inf")).to(tl.float32) - tl.load(lse_b + j)

    @triton.jit
    def _softmax_combine_kernel(y_ptr, lse_ptr, out_ptr, hist_ptr, hist_row0, max_len, stride_yb, stride_ob, stride_oh,
                                HKV: tl.constexpr, G: tl.constexpr, TOK: tl.constexpr, SHARED: tl.constexpr,
                                HIST: tl.constexpr):
        # softmax pass 2 over the stored scores y [rows, Hq, max_len] (log2 units) and each head's total
        # lse [rows, Hq]: out = ln sum_j exp2(y_j - lse_j) over the heads combined (all, or one KV head's G).
        # One head's row of TOK tokens at a time (contiguous), twice (max, then the sum; the second read hits
        # L1): elementwise, no reduction across threads (a [heads, TOK] tile reduced over its heads took 153 us
        # per 27B layer at 8 x 250K, H200 run 34). Non-candidates carry y = -inf and come out -inf.
        b = tl.program_id(0)
        t = tl.program_id(1) * TOK + tl.arange(0, TOK)
        tm = t < max_len
        row = y_ptr + b.to(tl.int64) * stride_yb + t
        LN2: tl.constexpr = 0.6931471805599453
        # Heads unrolled up to 32 (decode: 24); more (a prompt chunk's selection scores 16 rows x G
        # queries per KV head: 384 at the 27B shape) loop at run time: unrolled, Triton's coalesce pass fails
        # on the IR after minutes (H200 run 51).
        N: tl.constexpr = HKV * G if SHARED else G
        lse_b = lse_ptr + b * HKV * G
        for h in tl.static_range(1 if SHARED else HKV):
            m = tl.full((TOK,), float("-inf"), tl.float32)
            if N <= 32:
                for j in tl.static_range(N):
                    m = tl.maximum(m, _head_log_mass(row, lse_b, h * G + j, max_len, tm))
            else:
                for j in range(N):
                    m = tl.maximum(m, _head_log_mass(row, lse_b, h * G + j, max_len, tm))
            m = tl.where(m == float("-inf"), 0.0, m)
            acc = tl.zeros((TOK,), tl.float32)
            if N <= 32:
                for j in tl.static_range(N):
                    acc += tl.exp2(_head_log_mass(row, lse_b, h * G + j, max_len, tm) - m)
            else:
                for j in range(N):
                    acc += tl.exp2(_head_log_mass(row, lse_b, h * G + j, max_len, tm) - m)
            o = (m + tl.log2(acc)) * LN2
            tl.store(out_ptr + b * stride_ob + h * stride_oh + t, o, mask=tm)
            if HIST:   # top-k's first radix round of the scores just written (hist [4, rows, 256]: round 0 first)
                cnt = first_digit_histogram(o, tm)
                hrow = hist_row0 + b * (1 if SHARED else HKV) + h
                tl.atomic_add(hist_ptr + hrow * 256 + tl.arange(0, 256), cnt, mask=cnt > 0)


LSE_CHUNK = 4096   # tokens of one head per _head_lse_kernel program (32 per thread at 4 warps)
COMBINE_TOKENS = 1024   # tokens per _softmax_combine_kernel program (8 per thread at 4 warps)


def sketch_score_dot(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                     shared: bool = True, combine: str = "sum", sm_scale: float = 1.0, bpp: int = 2,
                     num_warps: int = 4, two_pass: bool = False,
                     scratch_bytes: int = SOFTMAX_SCRATCH_BYTES, unpack: str = "auto",
                     maxnreg: int | None = None, radix_hist: torch.Tensor | None = None,
                     lse_stride: int = 0, lse_min_samples: int = LSE_MIN_SAMPLES) -> torch.Tensor:
    """sketch_score on tensor cores (tl.dot, fp16 operands, fp32 accumulation); same meaning as
    sketch_score_ref up to q's fp16 rounding (see the kernel). Needs r % 32 == 0 (tl.dot: K = r/2 >= 16).
    softmax: the sketch scored once, head scores stored in fp16 for pass 2 (see _launch_score); two_pass=True:
    scored twice, nothing stored (the previous kernel, kept to measure against); lse_stride > 1: the normalizers
    from sampled positions first (lse_sample_strides), then one pass that scores and combines (two_pass ignored). bpp (blocks per program) and num_warps: swept on
    an H200 by benchmarks/bench_sketch_score.py. unpack: how int4 becomes fp16 (_int4_to_fp16): "asm" (PTX, CUDA
    only), "ops" (Triton ops), "auto" = asm on CUDA. maxnreg: a cap on registers per thread (ptxas), to trade
    spills for occupancy (swept by benchmarks/bench_sketch_score.py --maxnreg; None: the compiler's choice)."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if unpack not in ("auto", "asm", "ops"):
        raise ValueError(f"unpack must be auto, asm or ops, got {unpack!r}")
    qp = _as_groups(qp).contiguous()
    assert qp.shape[-1] % 32 == 0, "tl.dot needs K = r/2 >= 16 (and a power of two)"
    gp = max(16, triton.next_power_of_2(qp.shape[2]))
    return _launch_score(_sketch_score_dot_kernel, qp, sketch, scale, block_tables, seq_lens, sinks, recent,
                         max_len, shared, combine, sm_scale, bpp, num_warps, gp, store_heads=not two_pass,
                         scratch_bytes=scratch_bytes, radix_hist=radix_hist, lse_stride=lse_stride,
                         lse_min_samples=lse_min_samples,
                         **({} if maxnreg is None else {"maxnreg": maxnreg}),
                         # auto: PTX unless Triton chose its interpreter for the kernel at import
                         ASM=unpack == "asm" or (unpack == "auto" and qp.is_cuda
                                                 and isinstance(_sketch_score_dot_kernel, triton.runtime.JITFunction)))


def sketch_score(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                 shared: bool = True, combine: str = "sum", sm_scale: float = 1.0,
                 kernel: str = "auto", radix_hist: torch.Tensor | None = None, lse_stride: int = 0,
                 lse_min_samples: int = LSE_MIN_SAMPLES) -> torch.Tensor:
    """kernel: "fma" (CUDA-core dots, fp32), "dot" (tensor cores, sketch_score_dot; ranks not a multiple of 32
    take "fma": tl.dot needs r/2 >= 16), "dp4a" (integer dot products with int8 query codes, sketch_score_dp4a;
    its softmax: 254 us against dot's 242, run 92) or "auto": the faster one measured on an H200 at 8 x 250K, one layer
    of the 27B shape (runs 17, 29, 33, 48, 83-87, benchmarks/bench_sketch_score.py): dp4a for sum (78 us, 79% of
    the copy bandwidth, against fma's 119 and dot's 156) and for max (159 against fma's 311), dot for softmax (244 us
    with stored head scores, 519 scoring twice, 1,101 on CUDA cores: 24 per-head dots per token; 240 / 508 us
    replayed in CUDA graphs, run 48). radix_hist (topk.radix_hist_buffer; the Triton paths): filled with top-k's
    first radix round of the scores for topk_positions(hist=...) (see _launch_score); the PyTorch path ignores it.
    lse_stride > 1 (softmax): each head's normalizer estimated from every st-th position of its sequence, st =
    min(lse_stride, max(1, seq_len // lse_min_samples)) (lse_sample_strides, softmax_combine), which lets the dot
    kernel score and combine in one pass; on a GPU it needs that kernel (r % 32 == 0)."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "auto":
        kernel = {"softmax": "dot", "sum": "dp4a", "max": "dp4a"}[combine]
    lse_stride = lse_stride if combine == "softmax" else 0
    on_triton = triton is not None and (qp.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    if lse_stride > 1 and on_triton:
        if kernel == "dot" and _as_groups(qp).shape[-1] % 32 == 0:
            return sketch_score_dot(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared,
                                    combine, sm_scale, radix_hist=radix_hist, lse_stride=lse_stride,
                                    lse_min_samples=lse_min_samples)
        if qp.is_cuda:
            raise ValueError(f"a sampled softmax normalizer (lse_stride {lse_stride}) needs the dot kernel and a "
                             f"sketch rank that is a multiple of 32, got kernel {kernel} and rank "
                             f"{_as_groups(qp).shape[-1]}")
        # the CPU interpreter: the reference's estimate is the same (and top-k's first round counted after it)
        return _first_round(sketch_score_ref(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared,
                                             combine, sm_scale, lse_stride, lse_min_samples), radix_hist)
    if on_triton:
        if kernel == "dp4a" and qp.shape[-1] % 8 == 0:
            return sketch_score_dp4a(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared,
                                     combine, sm_scale, radix_hist=radix_hist)
        if kernel in ("dot", "dp4a") and qp.shape[-1] % 32 == 0:
            return sketch_score_dot(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared,
                                    combine, sm_scale, radix_hist=radix_hist)
        return sketch_score_triton(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared,
                                   combine, sm_scale, radix_hist=radix_hist)
    return sketch_score_ref(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared, combine,
                            sm_scale, lse_stride, lse_min_samples)
