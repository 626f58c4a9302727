"""What a token's key sketch rebuilds of its key: base = mean + basis x dequant(int4 coefficients).

The host tier's residual keys (sparse host_residual_keys) store k - base in the host rows and add base back on
every read. PyTorch reference (`sketch_base_ref`) + one Triton kernel that applies it in place of the torch
temporaries (an fp32 [rows, Hkv, D] base per layer and read: ~100 MB at 8 x 250K for the 27B shape): per block of
rows and KV head it dequantises the coefficients and multiplies them by the basis on the tensor cores, then adds or
subtracts it on the way through. The products are tf32: the base need not be the exact projection, only the same
on the write (k - base) and every read (+ base), and a row's product does not depend on the other rows of its tile.

Sketch layout: see ops/sketch.py (sketch [.., Hkv, r/2] uint8 at cache slots, scale [.., Hkv] fp16).
"""
import os

import torch

from sketchkv.ops.sketch import dequantize_int4

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def sketch_base_ref(slots: torch.Tensor, sketch: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                    basis: torch.Tensor) -> torch.Tensor:
    """Cache slots [N] -> fp32 [N, Hkv, D]: mean + basis x dequantised coefficients (0 where slot < 0)."""
    Hkv, r = basis.shape[0], basis.shape[-1]
    s = slots.clamp_min(0)
    coeff = dequantize_int4(sketch.view(-1, Hkv, r // 2)[s], scale.view(-1, Hkv)[s])
    base = mean + torch.einsum("nhr,hdr->nhd", coeff, basis)
    return torch.where((slots >= 0)[:, None, None], base, 0.0)


def row_slots(slots: torch.Tensor, hits: torch.Tensor | None, pool_slots: torch.Tensor | None) -> torch.Tensor:
    """Each row's cache slot: slots[n] where >= 0, else pool_slots[hits[n]] where hits[n] >= 0 (a hot-buffer row
    holding that slot's record), else -1."""
    if hits is None:
        return slots
    return torch.where(slots >= 0, slots, torch.where(hits >= 0, pool_slots[hits.clamp_min(0)], -1))


def apply_sketch_base(x: torch.Tensor, slots: torch.Tensor, sketch: torch.Tensor, scale: torch.Tensor,
                      mean: torch.Tensor, basis: torch.Tensor, sign: int, out: torch.Tensor | None = None,
                      hits: torch.Tensor | None = None, pool_slots: torch.Tensor | None = None,
                      chunk: int = 16384, block_rows: int = 64) -> torch.Tensor:
    """out = x + sign * base(slot) for rows [N, Hkv, D] with a slot (see row_slots; hits / pool_slots: the tier
    gather's hot rows and the pool's slot keys), x elsewhere (sign +1: residual keys -> keys, -1: keys -> residual
    keys). `out` may be x (in place: rows without a slot are not touched); default: a new tensor of x's dtype. On
    CUDA (or under the interpreter) one kernel; otherwise torch in chunks of rows (bounded fp32 temporaries)."""
    out = torch.empty_like(x) if out is None else out
    N, Hkv, D = x.shape
    r = basis.shape[-1]
    if N == 0:
        return out
    if (triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and x.stride(2) == 1
            and out.stride(2) == 1 and r >= 16 and r & (r - 1) == 0 and D >= 16 and D & (D - 1) == 0
            and basis.is_contiguous() and mean.is_contiguous() and sketch.is_contiguous() and scale.is_contiguous()
            and basis.dtype == mean.dtype == torch.float32):
        DC = min(D, 64)
        has_hits = hits is not None
        _apply_sketch_base_kernel[(triton.cdiv(N, block_rows), Hkv)](
            x, out, slots.contiguous(), hits.contiguous() if has_hits else slots, pool_slots if has_hits else slots,
            sketch, scale, mean, basis, N, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            SIGN=sign, HITS=has_hits, SAME=out.data_ptr() == x.data_ptr(), HKV=Hkv, D=D, R=r, BN=block_rows,
            DC=DC, num_warps=4)
        return out
    slots = row_slots(slots, hits, pool_slots)
    for i in range(0, N, chunk):
        xs = x[i:i + chunk]
        out[i:i + chunk] = xs.float() + sign * sketch_base_ref(slots[i:i + chunk], sketch, scale, mean, basis)
    return out


if triton is not None:
    @triton.jit
    def _apply_sketch_base_kernel(x_ptr, out_ptr, slot_ptr, hit_ptr, pool_slot_ptr, sk_ptr, sc_ptr, mean_ptr,
                                  basis_ptr, N, stride_xn, stride_xh, stride_on, stride_oh,
                                  SIGN: tl.constexpr, HITS: tl.constexpr, SAME: tl.constexpr, HKV: tl.constexpr,
                                  D: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, DC: tl.constexpr):
        # One program per (BN rows, KV head): the rows' coefficients [BN, R] once, the base in DC-wide dim chunks.
        # In place (SAME), rows without a slot are neither read nor written (the tier's resident rows).
        pid, h = tl.program_id(0), tl.program_id(1)
        n = pid * BN + tl.arange(0, BN)
        slot = tl.load(slot_ptr + n, mask=n < N, other=-1)
        if HITS:
            hit = tl.load(hit_ptr + n, mask=n < N, other=-1)
            slot = tl.where(slot >= 0, slot, tl.load(pool_slot_ptr + tl.maximum(hit, 0), mask=hit >= 0, other=-1))
        has = slot >= 0
        io = has if SAME else n < N
        s = tl.maximum(slot, 0).to(tl.int64) * HKV + h
        H2: tl.constexpr = R // 2
        packed = tl.load(sk_ptr + s[:, None] * H2 + tl.arange(0, H2)[None, :], mask=has[:, None], other=0)
        packed = packed.to(tl.int32)
        lo = (packed & 15) - 8
        hi = (packed >> 4) - 8
        sc = tl.load(sc_ptr + s, mask=has, other=0.0).to(tl.float32)
        coeff = tl.reshape(tl.join(lo, hi), (BN, R)).to(tl.float32) * sc[:, None]    # dims in order: lo = even
        r = tl.arange(0, R)
        for d0 in tl.static_range(0, D, DC):
            d = d0 + tl.arange(0, DC)
            bt = tl.load(basis_ptr + h * D * R + d[None, :] * R + r[:, None])            # basis[h, d, r]^T: [R, DC]
            base = tl.dot(coeff, bt) + tl.load(mean_ptr + h * D + d)[None, :]
            xv = tl.load(x_ptr + n[:, None].to(tl.int64) * stride_xn + h * stride_xh + d[None, :],
                         mask=io[:, None], other=0.0).to(tl.float32)
            y = tl.where(has[:, None], xv + SIGN * base, xv)
            tl.store(out_ptr + n[:, None].to(tl.int64) * stride_on + h * stride_oh + d[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=io[:, None])
