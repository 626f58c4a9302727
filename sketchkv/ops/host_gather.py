"""The host tier's miss path: read picked rows straight from host memory, dequantise, write K/V rows
on the GPU. PyTorch reference + Triton kernel + one dispatch; plus a whole-row copy (host_copy_rows: the raw
records only, dequantised afterwards from GPU memory) and the write path (GPU rows scattered into host memory by
a kernel).

Source: one layer's host rows, uint8 [R, row_bytes] (layout: sketchkv.ops.quant_kv), row = slot =
block * block_size + offset, the same slot numbers as the GPU KV cache.

Zero-copy (UVA): on CUDA the source is a *pinned* CPU tensor passed to the kernel as is. Triton 3.6's
launcher turns every tensor argument into a pointer by calling data_ptr() and then
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER) on it (triton/backends/nvidia/driver.py,
getPointer): for page-locked host memory (cudaHostAlloc, or cudaHostRegister'd with the mapped
flag) that returns the device-side address of the mapping (equal to the host address under UVA),
so loads in the kernel become PCIe reads of exactly the bytes touched; for pageable memory it fails
with "Pointer argument (at i) cannot be accessed from Triton (cpu tensor?)". Nothing else in the
launch looks at a tensor's device (the kernel runs on the current CUDA device), so no wrapping is
needed. The kernel gets several views of the one buffer (int32 words for int4 codes, int8, fp16 for
scales, bf16): same bytes, a pointer type per field. Under TRITON_INTERPRET=1 the same kernel
reads ordinary CPU memory.

Kernel: one program per ROWS picks (x one KV head in per-head mode); each loads the picks' whole
head records as one [ROWS, heads, words] tile (16-byte vectors: records are 16-byte aligned), so
all of a program's PCIe reads are in flight at once. Entries < 0 are skipped (hits, padding): the
caller passes a fixed-shape list, no compaction, no host sync, CUDA-graph capturable. Sorting the
picks by address (sort=True, or emit them in slot order) matters: DESIGN.md measured 62-92% of the
copy bandwidth sorted vs 30% unsorted for 131K picks over 8 GiB.
"""
import os

import torch

from sketchkv.ops.quant_kv import FORMATS, group_size, head_record_bytes, unpack_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: reference path only
    triton = None


def _check(src, rows, dst_k, dst_v, fmt, dst_rows, raw=None):
    assert fmt in FORMATS, fmt
    M, Hkv, D = dst_k.shape
    assert dst_v.shape == dst_k.shape and dst_k.stride(-1) == 1 and dst_v.stride(-1) == 1
    hb = head_record_bytes(fmt, D)
    assert src.dtype == torch.uint8 and src.dim() == 2 and src.shape[1] == Hkv * hb and src.is_contiguous(), \
        f"src must be uint8 [rows, {Hkv * hb}] contiguous"
    assert rows.dim() in (1, 2) and (rows.dim() == 1 or rows.shape[0] == Hkv), "rows: [N] or [Hkv, N]"
    if dst_rows is not None:
        assert dst_rows.shape == rows.shape
    if raw is not None:
        assert rows.dim() == 1, "raw records: shared picks only"
        assert raw.dtype == torch.uint8 and raw.shape == (M, Hkv * hb) and raw.is_contiguous(), \
            f"raw must be uint8 [{M}, {Hkv * hb}] contiguous"
    return Hkv, D, hb


# ---- reference ------------------------------------------------------------------------------------

def host_gather_ref(src, rows, dst_k, dst_v, fmt: str, dst_rows=None, raw=None):
    """Dequantise host rows into dst_k/dst_v [M, Hkv, D] (PyTorch; reads src from wherever it is).

    rows [N]: shared picks, every KV head of row rows[i] goes to dst[dst_rows[i]];
    rows [Hkv, N]: per-KV-head picks, head h of row rows[h, i] goes to dst[dst_rows[h, i], h].
    dst_rows defaults to arange(N) (per head too). Entries with rows < 0 are skipped.
    raw (shared picks only): uint8 [M, row_bytes] that also gets each picked row's record as stored,
    raw[dst_rows[i]] = src[rows[i]] (the host tier admits misses to its GPU hot pool in host format)."""
    Hkv, D, hb = _check(src, rows, dst_k, dst_v, fmt, dst_rows, raw)
    if dst_rows is None:
        dst_rows = torch.arange(rows.shape[-1], device=rows.device).expand_as(rows)
    per_head = rows.dim() == 2
    for h in range(Hkv if per_head else 1):
        r = rows[h] if per_head else rows
        d = dst_rows[h] if per_head else dst_rows
        ok = r >= 0
        r, d = r[ok].long().to(src.device), d[ok].long().to(dst_k.device)
        rec = src[r].view(-1, Hkv, hb)
        if raw is not None:
            raw[d.to(raw.device)] = rec.reshape(-1, Hkv * hb).to(raw.device)
        if per_head:
            k, v = unpack_kv(rec[:, h], fmt, D)
            dst_k[d, h] = k.to(dst_k.device, dst_k.dtype)
            dst_v[d, h] = v.to(dst_v.device, dst_v.dtype)
        else:
            k, v = unpack_kv(rec, fmt, D)
            dst_k[d] = k.to(dst_k.device, dst_k.dtype)
            dst_v[d] = v.to(dst_v.device, dst_v.dtype)
    return dst_k, dst_v


def host_copy_rows_ref(src, rows, dst):
    """dst[i] = src[rows[i]] for rows[i] >= 0 (uint8 rows as stored; others untouched)."""
    ok = rows >= 0
    dst[ok.nonzero().flatten().to(dst.device)] = src[rows[ok].long().to(src.device)].to(dst.device)
    return dst


def host_scatter_rows_ref(dst, slots, src, counter=None):
    """dst[slots[i]] = src[i] for slots[i] >= 0 (uint8 rows); counter (int64 [1]): += the bytes written."""
    ok = slots >= 0
    dst[slots[ok].long().to(dst.device)] = src[ok.to(src.device)].to(dst.device)
    if counter is not None:
        counter += ok.sum().to(counter.device) * src.shape[1]
    return dst


# ---- Triton ---------------------------------------------------------------------------------------

_FMT_ID = {"int4": 0, "int8": 1, "bf16": 2, "k8v4": 3}

if triton is not None:

    @triton.jit
    def _host_gather_kernel(
        data_ptr, scale_ptr, rows_ptr, drows_ptr, dk_ptr, dv_ptr, rawd_ptr, raws_ptr, n,
        stride_rh, stride_dh, stride_km, stride_kh, stride_vm, stride_vh,
        FMT: tl.constexpr, HKV: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, NG: tl.constexpr,
        ROW_BYTES: tl.constexpr, HEAD_BYTES: tl.constexpr, ROWS: tl.constexpr,
        PER_HEAD: tl.constexpr, HAS_DROWS: tl.constexpr, RAW: tl.constexpr,
    ):
        # program p: tiles p, p + programs, ... (one each unless the grid is capped: max_programs)
        for tile in range(tl.program_id(0), tl.cdiv(n, ROWS), tl.num_programs(0)):
            _gather_tile(tile, data_ptr, scale_ptr, rows_ptr, drows_ptr, dk_ptr, dv_ptr, rawd_ptr, raws_ptr, n,
                         stride_rh, stride_dh, stride_km, stride_kh, stride_vm, stride_vh, FMT, HKV, HP, D, NG,
                         ROW_BYTES, HEAD_BYTES, ROWS, PER_HEAD, HAS_DROWS, RAW)

    @triton.jit
    def _gather_tile(
        tile, data_ptr, scale_ptr, rows_ptr, drows_ptr, dk_ptr, dv_ptr, rawd_ptr, raws_ptr, n,
        stride_rh, stride_dh, stride_km, stride_kh, stride_vm, stride_vh,
        FMT: tl.constexpr, HKV: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, NG: tl.constexpr,
        ROW_BYTES: tl.constexpr, HEAD_BYTES: tl.constexpr, ROWS: tl.constexpr,
        PER_HEAD: tl.constexpr, HAS_DROWS: tl.constexpr, RAW: tl.constexpr,
    ):
        # RAW: also store each record as read (same views as data/scale) at its destination row
        i = tile * ROWS + tl.arange(0, ROWS)
        if PER_HEAD:  # HP == 1: this program's KV head
            h0 = tl.program_id(1)
            heads = h0 + tl.arange(0, HP)
            rows_ptr += h0 * stride_rh
            drows_ptr += h0 * stride_dh
        else:
            heads = tl.arange(0, HP)
        r = tl.load(rows_ptr + i, mask=i < n, other=-1).to(tl.int64)
        ok = r >= 0
        if HAS_DROWS:
            dr = tl.load(drows_ptr + i, mask=ok, other=0).to(tl.int64)
        else:
            dr = i.to(tl.int64)
        m2 = ok[:, None] & (heads < HKV)[None, :]                       # [ROWS, HP]
        m3 = m2[:, :, None]
        # offsets of each head record in units of the view's element (constant multipliers keep the
        # 16-byte alignment visible to the compiler -> 16-byte vector loads)
        rec2 = r[:, None] * (ROW_BYTES // 2) + heads[None, :] * (HEAD_BYTES // 2)   # fp16 / bf16 units
        d = tl.arange(0, D)
        if FMT == 0:  # int4: codes as int32 words (8 nibbles), fp16 scale per group
            w = tl.arange(0, D // 8)
            rec4 = r[:, None] * (ROW_BYTES // 4) + heads[None, :] * (HEAD_BYTES // 4)
            wb = rec4[:, :, None] + w[None, None, :]
            kw = tl.load(data_ptr + wb, mask=m3, other=0)
            vw = tl.load(data_ptr + wb + D // 8, mask=m3, other=0)
            g = tl.arange(0, 2 * NG)  # K then V scales, after the D code bytes: one 4*NG-byte load
            sc = tl.load(scale_ptr + (rec2 + D // 2)[:, :, None] + g[None, None, :], mask=m3, other=0.0)
            if RAW:
                wr = (dr[:, None] * (ROW_BYTES // 4) + heads[None, :] * (HEAD_BYTES // 4))[:, :, None] + w[None, None, :]
                tl.store(rawd_ptr + wr, kw, mask=m3)
                tl.store(rawd_ptr + wr + D // 8, vw, mask=m3)
                sr = (dr[:, None] * (ROW_BYTES // 2) + heads[None, :] * (HEAD_BYTES // 2) + D // 2)[:, :, None]
                tl.store(raws_ptr + sr + g[None, None, :], sc, mask=m3)
            ks, vs = tl.split(tl.permute(tl.reshape(sc.to(tl.float32), [ROWS, HP, 2, NG]), (0, 1, 3, 2)))
            sh = tl.arange(0, 8) * 4
            kq = (((kw[:, :, :, None] >> sh[None, None, None, :]) & 15) - 8).to(tl.float32)
            vq = (((vw[:, :, :, None] >> sh[None, None, None, :]) & 15) - 8).to(tl.float32)
            k = tl.reshape(tl.reshape(kq, [ROWS, HP, NG, D // NG]) * ks[:, :, :, None], [ROWS, HP, D])
            v = tl.reshape(tl.reshape(vq, [ROWS, HP, NG, D // NG]) * vs[:, :, :, None], [ROWS, HP, D])
        elif FMT == 1:  # int8 codes, one fp16 scale each for K and V after them
            rec1 = r[:, None] * ROW_BYTES + heads[None, :] * HEAD_BYTES
            db = rec1[:, :, None] + d[None, None, :]
            kq = tl.load(data_ptr + db, mask=m3, other=0)
            vq = tl.load(data_ptr + db + D, mask=m3, other=0)
            ks = tl.load(scale_ptr + rec2 + D, mask=m2, other=0.0)
            vs = tl.load(scale_ptr + rec2 + D + 1, mask=m2, other=0.0)
            if RAW:
                wr = (dr[:, None] * ROW_BYTES + heads[None, :] * HEAD_BYTES)[:, :, None] + d[None, None, :]
                tl.store(rawd_ptr + wr, kq, mask=m3)
                tl.store(rawd_ptr + wr + D, vq, mask=m3)
                sr = dr[:, None] * (ROW_BYTES // 2) + heads[None, :] * (HEAD_BYTES // 2) + D
                tl.store(raws_ptr + sr, ks, mask=m2)
                tl.store(raws_ptr + sr + 1, vs, mask=m2)
            k = kq.to(tl.float32) * ks.to(tl.float32)[:, :, None]
            v = vq.to(tl.float32) * vs.to(tl.float32)[:, :, None]
        elif FMT == 3:  # k8v4: int8 K codes then int4 V codes, both read as int32 words; K's scale, V's group scales
            rec4 = r[:, None] * (ROW_BYTES // 4) + heads[None, :] * (HEAD_BYTES // 4)
            wk = tl.arange(0, D // 4)
            wv = tl.arange(0, D // 8)
            g = tl.arange(0, NG)
            kw = tl.load(data_ptr + rec4[:, :, None] + wk[None, None, :], mask=m3, other=0)
            vw = tl.load(data_ptr + rec4[:, :, None] + D // 4 + wv[None, None, :], mask=m3, other=0)
            ks = tl.load(scale_ptr + rec2 + 3 * D // 4, mask=m2, other=0.0)
            vs = tl.load(scale_ptr + (rec2 + 3 * D // 4 + 1)[:, :, None] + g[None, None, :], mask=m3, other=0.0)
            if RAW:
                wr = (dr[:, None] * (ROW_BYTES // 4) + heads[None, :] * (HEAD_BYTES // 4))[:, :, None]
                tl.store(rawd_ptr + wr + wk[None, None, :], kw, mask=m3)
                tl.store(rawd_ptr + wr + D // 4 + wv[None, None, :], vw, mask=m3)
                sr = dr[:, None] * (ROW_BYTES // 2) + heads[None, :] * (HEAD_BYTES // 2) + 3 * D // 4
                tl.store(raws_ptr + sr, ks, mask=m2)
                tl.store(raws_ptr + (sr + 1)[:, :, None] + g[None, None, :], vs, mask=m3)
            sk = (3 - tl.arange(0, 4)) * 8       # byte i of a word (dim 4w + i) to the top, then back: sign-extended
            kq = ((kw[:, :, :, None] << sk[None, None, None, :]) >> 24).to(tl.float32)
            k = tl.reshape(kq, [ROWS, HP, D]) * ks.to(tl.float32)[:, :, None]
            sh = tl.arange(0, 8) * 4
            vq = (((vw[:, :, :, None] >> sh[None, None, None, :]) & 15) - 8).to(tl.float32)
            v = tl.reshape(tl.reshape(vq, [ROWS, HP, NG, D // NG]) * vs.to(tl.float32)[:, :, :, None], [ROWS, HP, D])
        else:  # bf16
            db = rec2[:, :, None] + d[None, None, :]
            kb = tl.load(data_ptr + db, mask=m3, other=0.0)
            vb = tl.load(data_ptr + db + D, mask=m3, other=0.0)
            if RAW:
                wr = (dr[:, None] * (ROW_BYTES // 2) + heads[None, :] * (HEAD_BYTES // 2))[:, :, None] + d[None, None, :]
                tl.store(rawd_ptr + wr, kb, mask=m3)
                tl.store(rawd_ptr + wr + D, vb, mask=m3)
            k = kb.to(tl.float32)
            v = vb.to(tl.float32)
        ko = dk_ptr + dr[:, None, None] * stride_km + heads[None, :, None] * stride_kh + d[None, None, :]
        vo = dv_ptr + dr[:, None, None] * stride_vm + heads[None, :, None] * stride_vh + d[None, None, :]
        tl.store(ko, k.to(dk_ptr.dtype.element_ty), mask=m3)
        tl.store(vo, v.to(dv_ptr.dtype.element_ty), mask=m3)

    @triton.jit
    def _scatter_rows_kernel(src_ptr, slots_ptr, dst_ptr, cnt_ptr, n,
                             RW: tl.constexpr, RW_PAD: tl.constexpr, ROWS: tl.constexpr, COUNT: tl.constexpr):
        """dst[slots[i]] = src[i], rows of RW int32 words; slots < 0 skipped. COUNT: cnt_ptr[0] += bytes written
        (one atomic per program: the tier's write counter without 4 torch kernels per layer and step)."""
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        s = tl.load(slots_ptr + i, mask=i < n, other=-1).to(tl.int64)
        w = tl.arange(0, RW_PAD)
        m = (s >= 0)[:, None] & (w < RW)[None, :]
        x = tl.load(src_ptr + i.to(tl.int64)[:, None] * RW + w[None, :], mask=m, other=0)
        tl.store(dst_ptr + s[:, None] * RW + w[None, :], x, mask=m)
        if COUNT:
            tl.atomic_add(cnt_ptr, tl.sum((s >= 0).to(tl.int64), 0) * (RW * 4))

    @triton.jit
    def _host_copy_rows_kernel(src_ptr, rows_ptr, dst_ptr, n, RW: tl.constexpr, HEAD: tl.constexpr,
                               TAIL: tl.constexpr, ROWS: tl.constexpr):
        """dst[i] = src[rows[i]], rows of RW int32 words read whole: the first HEAD words (a power of two) as one
        unmasked run per row (16-byte vectors), the TAIL words after them (TAIL a power of two >= RW - HEAD) masked;
        rows < 0 skipped. Programs loop over tiles of ROWS rows (the grid may be capped, see host_gather_triton)."""
        for tile in range(tl.program_id(0), tl.cdiv(n, ROWS), tl.num_programs(0)):
            i = tile * ROWS + tl.arange(0, ROWS)
            r = tl.load(rows_ptr + i, mask=i < n, other=-1).to(tl.int64)
            ok = (r >= 0)[:, None]
            a = tl.arange(0, HEAD)[None, :]
            src_row = src_ptr + r[:, None] * RW
            dst_row = dst_ptr + i.to(tl.int64)[:, None] * RW
            tl.store(dst_row + a, tl.load(src_row + a, mask=ok, other=0), mask=ok)
            if TAIL > 0:
                b = HEAD + tl.arange(0, TAIL)[None, :]
                m = ok & (b < RW)
                tl.store(dst_row + b, tl.load(src_row + b, mask=m, other=0), mask=m)

    _INTERPRETED = not isinstance(_host_gather_kernel, triton.runtime.JITFunction)
else:
    _INTERPRETED = False


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or (_INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"))


def default_rows_per_program(heads: int, head_dim: int) -> int:
    """~4K dequantised values of K (and as many of V) per program: bounded registers, and several
    rows' PCIe reads in flight per program. 27B shape (4 heads x 256): 4 rows shared, 16 per head."""
    return triton.next_power_of_2(max(1, min(64, 4096 // (heads * head_dim))))


def _views(buf, fmt):
    """(codes, scales) views of uint8 rows, the element types the kernel reads them as."""
    if fmt in ("int4", "k8v4"):
        return buf.view(torch.int32), buf.view(torch.float16)
    if fmt == "int8":
        return buf.view(torch.int8), buf.view(torch.float16)
    return buf.view(torch.bfloat16), buf.view(torch.bfloat16)


def host_gather_triton(src, rows, dst_k, dst_v, fmt: str, dst_rows=None, raw=None, *, rows_per_program=None,
                       num_warps=4, max_programs=None):
    """max_programs: cap the grid (each program then loops over its share of the tiles), leaving SMs to kernels
    of other streams while the PCIe reads are in flight (default: one program per tile)."""
    Hkv, D, hb = _check(src, rows, dst_k, dst_v, fmt, dst_rows, raw)
    assert D & (D - 1) == 0 and D >= 16, "head_dim must be a power of two >= 16"
    assert rows.stride(-1) == 1 and (dst_rows is None or dst_rows.stride(-1) == 1)
    if dst_k.is_cuda and not torch.cuda.is_current_stream_capturing():
        assert src.is_cuda or src.is_pinned(), "host rows must be pinned (page-locked) for zero-copy reads"
    per_head = rows.dim() == 2
    N = rows.shape[-1]
    if N == 0:
        return dst_k, dst_v
    HP = 1 if per_head else triton.next_power_of_2(Hkv)
    ROWS = rows_per_program or default_rows_per_program(HP, D)
    assert ROWS & (ROWS - 1) == 0, "rows_per_program must be a power of two"
    data, scale = _views(src, fmt)
    raw_data, raw_scale = _views(raw, fmt) if raw is not None else (data, scale)  # dummies when absent
    drows = dst_rows if dst_rows is not None else rows  # dummy pointer when absent
    grid = (min(triton.cdiv(N, ROWS), max_programs or N), Hkv if per_head else 1)
    _host_gather_kernel[grid](
        data, scale, rows, drows, dst_k, dst_v, raw_data, raw_scale, N,
        rows.stride(0) if per_head else 0, drows.stride(0) if per_head else 0,
        dst_k.stride(0), dst_k.stride(1), dst_v.stride(0), dst_v.stride(1),
        FMT=_FMT_ID[fmt], HKV=Hkv, HP=HP, D=D, NG=D // group_size(D) if fmt in ("int4", "k8v4") else 1,
        ROW_BYTES=Hkv * hb, HEAD_BYTES=hb, ROWS=ROWS, PER_HEAD=per_head, HAS_DROWS=dst_rows is not None,
        RAW=raw is not None, num_warps=num_warps,
    )
    return dst_k, dst_v


def host_gather(src, rows, dst_k, dst_v, fmt: str, dst_rows=None, *, raw=None, sort: bool = False, segments: int = 1,
                **kw):
    """Read host rows `rows` of `src` (one layer's uint8 rows) into dst_k/dst_v [M, Hkv, D].

    rows [N] (one pick per token, all KV heads) or [Hkv, N] (per-KV-head picks), int32/int64,
    entries < 0 skipped; dst_rows (same shape, default arange(N)): where each pick lands in dst
    (a per-step scratch, or hot-buffer slots). raw (shared picks): uint8 [M, row_bytes] that also
    receives each pick's record as stored (see host_gather_ref). sort=True orders the picks by address first (on the
    device, no sync), within each of `segments` equal parts of the last dim (the host tier: one per sequence, whose
    rows live in its own blocks, so this has a global sort's locality). Triton on CUDA (src pinned or on the GPU) and under TRITON_INTERPRET=1; the
    reference otherwise. kw: rows_per_program, num_warps, max_programs (kernel knobs)."""
    if sort:
        # 32-bit keys (host rows < 2^31). Segments of <= 4096 keys sort inside one block each: one kernel, where
        # the tier's flattened batch took 8 radix passes (58 us per layer at 8 x 250K, H200 run 35; 20 in run 38).
        keys = (rows.to(torch.int32) if src.shape[0] < 2**31 else rows).unflatten(-1, (segments, -1))
        keys, perm = torch.sort(keys, dim=-1)
        perm = perm + torch.arange(segments, device=perm.device)[:, None] * keys.shape[-1]
        rows, perm = keys.flatten(-2), perm.flatten(-2)
        if dst_rows is None:
            dst_rows = perm
        else:
            dst_rows = dst_rows.gather(-1, perm)
        dst_rows = dst_rows.contiguous()
    if _use_triton(dst_k):
        return host_gather_triton(src, rows.contiguous(), dst_k, dst_v, fmt, dst_rows, raw, **kw)
    return host_gather_ref(src, rows, dst_k, dst_v, fmt, dst_rows, raw)


def host_copy_rows_triton(src, rows, dst, *, rows_per_program=8, num_warps=4, max_programs=None):
    rb = src.shape[1]
    assert src.dtype == dst.dtype == torch.uint8 and dst.shape == (rows.shape[0], rb) and rb % 4 == 0
    assert src.is_contiguous() and dst.is_contiguous() and rows.dim() == 1 and rows.is_contiguous()
    if dst.is_cuda and not torch.cuda.is_current_stream_capturing():
        assert src.is_cuda or src.is_pinned(), "host rows must be pinned (page-locked) for zero-copy reads"
    n = rows.shape[0]
    if n == 0:
        return dst
    RW = rb // 4
    head = 1 << (RW.bit_length() - 1)
    tail = triton.next_power_of_2(RW - head) if RW > head else 0
    grid = (min(triton.cdiv(n, rows_per_program), max_programs or n),)
    _host_copy_rows_kernel[grid](src.view(torch.int32), rows, dst.view(torch.int32), n, RW=RW, HEAD=head, TAIL=tail,
                                 ROWS=rows_per_program, num_warps=num_warps)
    return dst


def host_copy_rows(src, rows, dst, **kw):
    """dst[i] = src[rows[i]] (uint8 rows as stored, e.g. pinned host rows -> GPU; rows [N], < 0 skipped, those dst
    rows untouched). On CUDA (src pinned or on the GPU) and under TRITON_INTERPRET=1 one kernel reading each row
    whole (1,088-byte int4 rows: a 1,024-byte and a 64-byte run) instead of host_gather's per-field loads; graph-
    capturable, no host sync. kw: rows_per_program, num_warps, max_programs."""
    if _use_triton(dst):
        return host_copy_rows_triton(src, rows, dst, **kw)
    return host_copy_rows_ref(src, rows, dst)


def host_scatter_rows_triton(dst, slots, src, counter=None, *, rows_per_program=8, num_warps=4):
    T, rb = src.shape
    assert dst.dtype == src.dtype == torch.uint8 and dst.shape[1] == rb and rb % 4 == 0
    assert dst.is_contiguous() and src.is_contiguous() and slots.is_contiguous()
    if src.is_cuda and not torch.cuda.is_current_stream_capturing():
        assert dst.is_cuda or dst.is_pinned(), "host rows must be pinned (page-locked) for zero-copy writes"
    if T == 0:
        return dst
    RW = rb // 4
    if counter is not None:
        assert counter.dtype == torch.int64 and counter.device == src.device
    _scatter_rows_kernel[(triton.cdiv(T, rows_per_program),)](
        src.view(torch.int32), slots, dst.view(torch.int32), counter if counter is not None else slots, T,
        RW=RW, RW_PAD=triton.next_power_of_2(RW), ROWS=rows_per_program, COUNT=counter is not None,
        num_warps=num_warps)
    return dst


def host_scatter_rows(dst, slots, src, counter=None, **kw):
    """dst[slots[i]] = src[i] (uint8 rows; slots < 0 skipped); counter (int64 [1] on src's device, optional):
    += the bytes written. On CUDA a kernel writes straight into the pinned dst (zero-copy,
    graph-capturable); on CPU an index copy."""
    if _use_triton(src):
        return host_scatter_rows_triton(dst, slots, src, counter, **kw)
    return host_scatter_rows_ref(dst, slots, src, counter)
