"""K/V rows of the host tier: quantisation (int4 / int8 / bf16) and the byte layout of a row.

A host row holds one token of one full-attention layer: K and V of every KV head, as Hkv *head
records* side by side, each padded to a multiple of 16 bytes (so every record starts 16-byte
aligned and the gather kernel reads it with 16-byte vector loads):

  int4  [K: D/2 B][V: D/2 B][K scales: D/G fp16][V scales: D/G fp16][pad]   G = min(64, D)
        two signed 4-bit values per byte, low nibble = even dim, high nibble = odd dim, stored as
        q + 8 with q in [-7, 7] (the convention of sketchkv.ops.sketch); symmetric, one scale per
        group of G consecutive dims: s = max|x| / 7.   D=256: 128+128+8+8 = 272 B (no pad)
  int8  [K: D int8][V: D int8][K scale fp16][V scale fp16][pad]   one scale per token and head:
        s = max|x| / 127, q in [-127, 127].                      D=256: 516 -> 528 B
  bf16  [K: D bf16][V: D bf16]                                   D=256: 1024 B
  k8v4  [K: D int8][V: D/2 B int4][K scale fp16][V scales: D/G fp16][pad]   keys as int8, values as int4:
        the keys carry the int4 format's KL (benchmarks/results/int4-kv-split-cpu-2026-12-03/).
                                                                 D=256: 256+128+2+8 = 394 -> 400 B

(bytes per head record; a row is Hkv records: 1088 / 2112 / 4096 / 1600 B for 4 KV heads x 256.)
Multi-byte fields are little-endian (x86 hosts and NVIDIA GPUs): the kernel reads the scales
through a float16 view of the same buffer and the int4 codes as int32 words (8 nibbles each,
nibble i of a word = dim 8w + i).

Round-trip error bounds, exact for finite inputs (x read as fp32, s the *stored* fp16 scale, which
is what both the reference and the kernel multiply by; q * s is exact in fp32):
  int4  |x - x^| <= s/2 per element, s the scale of its group: the code is round(x / s) clamped to
        [-7, 7], and |x| / s <= 7 * (1 + 2^-11) < 7.5 because s is max|x| / 7 rounded to the nearest
        fp16, so the clamp never costs more than rounding does. I.e. |x - x^| <= max|x| / 14 * (1 + 2^-10).
  int8  the same with 127: |x - x^| <= s/2 <= max|x| / 254 * (1 + 2^-10), per token and head.
  bf16  round to nearest (8-bit significand): |x - x^| <= 2^-8 |x| (exact when the cache is bf16).
  k8v4  K as int8, V as int4 (error_bound(x, "k8v4", part)).
(The division x / s is done in fp32; at a rounding boundary that can move a code by one only when
|x / s - (n + 1/2)| < 2^-23 * 8, adding at most ~2^-20 * s: the tests allow a 1e-6 relative slack.)
Scales are clamped to [2^-24, 65504] (fp16 range): all-zero groups round-trip to 0; inputs beyond
7 * 65504 (int4) / 127 * 65504 (int8) saturate, and such K/V do not occur in practice.

On CUDA (and under TRITON_INTERPRET=1) int4 and k8v4 records are packed by one kernel (`pack_kv_triton`, the
same bytes as the reference: IEEE division, round half to even); unfused, packing a decode step's rows took
~30 small kernels per full-attention layer (k8v4 until session 20: 1.2 ms per 27B step at 8 x 250K, H200 run 74).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FORMATS = ("int4", "int8", "bf16", "k8v4")
_FP16_MIN, _FP16_MAX = 2.0 ** -24, 65504.0


def group_size(head_dim: int) -> int:
    """Dims per int4 scale group."""
    return min(64, head_dim)


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def record_fields_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of a head record's fields, before the padding to 16."""
    D = head_dim
    if fmt in ("int4", "k8v4"):
        assert D % 8 == 0 and D % group_size(D) == 0, f"{fmt} host rows need head_dim a multiple of 8"
        scales = 2 * (D // group_size(D))
        return D + 2 * scales if fmt == "int4" else D + D // 2 + 2 + scales
    if fmt == "int8":
        return 2 * D + 4
    if fmt == "bf16":
        return 4 * D
    raise ValueError(f"unknown host KV format {fmt!r} (one of {FORMATS})")


def head_record_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one token's K+V for one KV head (a head record, 16-byte padded)."""
    return _pad16(record_fields_bytes(fmt, head_dim))


def row_bytes(fmt: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one host row: one token of one layer, all KV heads."""
    return num_kv_heads * head_record_bytes(fmt, head_dim)


# ---- int4, groups of G dims ---------------------------------------------------------------------

def quantize_int4(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed uint8 [..., D/2], scale fp16 [..., D/G])."""
    D = x.shape[-1]
    G = group or group_size(D)
    xg = x.float().reshape(*x.shape[:-1], D // G, G)
    scale = (xg.abs().amax(-1) / 7.0).clamp(_FP16_MIN, _FP16_MAX).to(torch.float16)
    q = torch.round(xg / scale.float()[..., None]).clamp_(-7, 7).to(torch.int16) + 8
    q = q.reshape(*x.shape[:-1], D)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)
    return packed, scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(packed uint8 [..., D/2], scale fp16 [..., D/G]) -> fp32 [..., D]."""
    lo = (packed & 0xF).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    q = torch.stack([lo, hi], dim=-1).flatten(-2).float()
    NG = scale.shape[-1]
    return (q.unflatten(-1, (NG, -1)) * scale.float()[..., None]).flatten(-2)


# ---- int8, one scale per vector ----------------------------------------------------------------

def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], scale fp16 [...])."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127.0).clamp(_FP16_MIN, _FP16_MAX).to(torch.float16)
    q = torch.round(xf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[..., None]


# ---- whole head records --------------------------------------------------------------------------

def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret the last dim of t as bytes."""
    return t.contiguous().view(torch.uint8)


if triton is not None:

    @triton.jit
    def _round_half_even(y):
        r = tl.floor(y)
        f = y - r                                   # exact for |y| < 2^23
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)

    @triton.jit
    def _int4_groups(x_ptr, codes_ptr, scales_ptr, NG: tl.constexpr, G: tl.constexpr):
        # one vector [NG * G] -> codes (D / 2 bytes) and NG fp16 scales, as quantize_int4
        x = tl.load(x_ptr + tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]).to(tl.float32)
        s = tl.minimum(tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), 7.0), 5.960464477539063e-08), 65504.0)
        s = s.to(tl.float16)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, s.to(tl.float32)[:, None])), -7.0), 7.0)
        lo, hi = tl.split(tl.reshape(q.to(tl.int32) + 8, (NG * G // 2, 2)))
        tl.store(codes_ptr + tl.arange(0, NG * G // 2), (lo | (hi << 4)).to(tl.uint8))
        tl.store(scales_ptr + tl.arange(0, NG), s)

    @triton.jit
    def _int8_vector(x_ptr, codes_ptr, scale_ptr, D: tl.constexpr):
        # one vector [D] -> D int8 codes and one fp16 scale, as quantize_int8
        x = tl.load(x_ptr + tl.arange(0, D)).to(tl.float32)
        s = tl.minimum(tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), 127.0), 5.960464477539063e-08), 65504.0)
        s = s.to(tl.float16)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, s.to(tl.float32))), -127.0), 127.0)
        tl.store(codes_ptr + tl.arange(0, D), q.to(tl.int8).to(tl.uint8, bitcast=True))
        tl.store(scale_ptr, s)

    @triton.jit
    def _pack_kv_kernel(k_ptr, v_ptr, rec_ptr, rec16_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                        HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, RB: tl.constexpr, K8: tl.constexpr,
                        USED: tl.constexpr, PADP: tl.constexpr):
        # program (token t, KV head h): its head record, int4 [K codes][V codes][K scales][V scales] or
        # (K8) k8v4 [K int8][V codes][K scale][V scales], then zeros up to RB (USED: the fields' bytes, PADP: the
        # padding's, rounded up to a power of two); rec16: the same bytes as fp16 (scales at even offsets)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        NG: tl.constexpr = D // G
        rec = rec_ptr + (t * HKV + h) * RB
        rec16 = rec16_ptr + (t * HKV + h) * (RB // 2)
        k = k_ptr + t * stride_kt + h * stride_kh
        v = v_ptr + t * stride_vt + h * stride_vh
        if K8:
            _int8_vector(k, rec, rec16 + 3 * D // 4, D)
            _int4_groups(v, rec + D, rec16 + 3 * D // 4 + 1, NG, G)
        else:
            _int4_groups(k, rec, rec16 + D // 2, NG, G)
            _int4_groups(v, rec + D // 2, rec16 + D // 2 + NG, NG, G)
        if RB > USED:
            pad = tl.arange(0, PADP)
            tl.store(rec + USED + pad, tl.zeros([PADP], tl.uint8), mask=pad < RB - USED)


def pack_kv_triton(k: torch.Tensor, v: torch.Tensor, fmt: str = "int4",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """pack_kv(k, v, fmt) in one kernel for fmt int4 or k8v4: k, v [T, Hkv, D] (head dims contiguous) ->
    uint8 [T, Hkv, RB] (into `out` if given: every byte is written, padding included)."""
    T, Hkv, D = k.shape
    G, RB = group_size(D), head_record_bytes(fmt, D)
    assert fmt in ("int4", "k8v4") and k.stride(2) == v.stride(2) == 1 and G & (G - 1) == 0
    assert D // G & (D // G - 1) == 0 and (fmt == "int4" or D % 4 == 0)
    used = record_fields_bytes(fmt, D)
    rec = torch.empty(T, Hkv, RB, dtype=torch.uint8, device=k.device) if out is None else out
    assert rec.shape == (T, Hkv, RB) and rec.dtype == torch.uint8 and rec.is_contiguous()
    if T:
        _pack_kv_kernel[(T, Hkv)](k, v, rec, rec.view(torch.float16), k.stride(0), k.stride(1), v.stride(0),
                                  v.stride(1), HKV=Hkv, D=D, G=G, RB=RB, K8=fmt == "k8v4", USED=used,
                                  PADP=triton.next_power_of_2(max(RB - used, 1)), num_warps=2)
    return rec


def pack_kv(k: torch.Tensor, v: torch.Tensor, fmt: str) -> torch.Tensor:
    """k, v [..., Hkv, D] -> head records uint8 [..., Hkv, head_record_bytes] on k's device."""
    if fmt in ("int4", "k8v4") and triton is not None and k.dim() == 3 and k.stride(2) == v.stride(2) == 1 and (
            k.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return pack_kv_triton(k, v, fmt)
    return pack_kv_ref(k, v, fmt)


def pack_kv_ref(k: torch.Tensor, v: torch.Tensor, fmt: str) -> torch.Tensor:
    """pack_kv in torch (the reference)."""
    D = k.shape[-1]
    if fmt == "int4":
        kq, ks = quantize_int4(k)
        vq, vs = quantize_int4(v)
        parts = [kq, vq, _bytes(ks), _bytes(vs)]
    elif fmt == "int8":
        kq, ks = quantize_int8(k)
        vq, vs = quantize_int8(v)
        parts = [_bytes(kq), _bytes(vq), _bytes(ks[..., None]), _bytes(vs[..., None])]
    elif fmt == "bf16":
        parts = [_bytes(k.to(torch.bfloat16)), _bytes(v.to(torch.bfloat16))]
    elif fmt == "k8v4":
        kq, ks = quantize_int8(k)
        vq, vs = quantize_int4(v)
        parts = [_bytes(kq), vq, _bytes(ks[..., None]), _bytes(vs)]
    else:
        raise ValueError(f"unknown host KV format {fmt!r}")
    rec = torch.cat(parts, dim=-1)
    pad = head_record_bytes(fmt, D) - rec.shape[-1]
    if pad:
        rec = torch.nn.functional.pad(rec, (0, pad))
    return rec


def unpack_kv(rec: torch.Tensor, fmt: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head records uint8 [..., head_record_bytes] -> (k, v) fp32 [..., D] (the PyTorch reference)."""
    D = head_dim
    assert rec.dtype == torch.uint8 and rec.shape[-1] == head_record_bytes(fmt, D)
    if fmt == "int4":
        NG = D // group_size(D)
        ks = rec[..., D:D + 2 * NG].contiguous().view(torch.float16)
        vs = rec[..., D + 2 * NG:D + 4 * NG].contiguous().view(torch.float16)
        return dequantize_int4(rec[..., :D // 2], ks), dequantize_int4(rec[..., D // 2:D], vs)
    if fmt == "int8":
        kq = rec[..., :D].contiguous().view(torch.int8)
        vq = rec[..., D:2 * D].contiguous().view(torch.int8)
        ks = rec[..., 2 * D:2 * D + 2].contiguous().view(torch.float16)[..., 0]
        vs = rec[..., 2 * D + 2:2 * D + 4].contiguous().view(torch.float16)[..., 0]
        return dequantize_int8(kq, ks), dequantize_int8(vq, vs)
    if fmt == "bf16":
        k = rec[..., :2 * D].contiguous().view(torch.bfloat16).float()
        v = rec[..., 2 * D:4 * D].contiguous().view(torch.bfloat16).float()
        return k, v
    if fmt == "k8v4":
        NG = D // group_size(D)
        kq = rec[..., :D].contiguous().view(torch.int8)
        e = D + D // 2
        ks = rec[..., e:e + 2].contiguous().view(torch.float16)[..., 0]
        vs = rec[..., e + 2:e + 2 + 2 * NG].contiguous().view(torch.float16)
        return dequantize_int8(kq, ks), dequantize_int4(rec[..., D:e], vs)
    raise ValueError(f"unknown host KV format {fmt!r}")


def error_bound(x: torch.Tensor, fmt: str, part: str = "k") -> torch.Tensor:
    """Per-element bound on |x - dequant(quant(x))| for x [..., D] (see the module docstring); part "k" or "v":
    which half of a k8v4 record x is (int8 keys, int4 values)."""
    xf = x.float()
    D = x.shape[-1]
    if fmt == "k8v4":
        fmt = "int8" if part == "k" else "int4"
    if fmt == "int4":
        _, s = quantize_int4(x)
        return (s.float() / 2).repeat_interleave(group_size(D), dim=-1)
    if fmt == "int8":
        _, s = quantize_int8(x)
        return (s.float() / 2)[..., None].expand_as(xf)
    return xf.abs() * 2.0 ** -8
