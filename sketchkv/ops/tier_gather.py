"""The host tier's compact K/V scratch for one layer and step: every selected row's source in one pass.

For each sequence b and scratch row j (position p = pos[b, j], the first counts[b] valid):
  sink   p < sinks                         -> the resident row  slot * width + p
  tail   p >= max(seq_len - recent, sinks) -> the resident ring slot * width + sinks + p % ring
         (ring >= recent: verification rows of one sequence share a ring of recent + drafts rows)
  pick   otherwise: host slot = block_tables[b, p // bs] * bs + p % bs, looked up in the hot map:
         a hot row (hit[b, j] = the pool row; its reference bit is set) or a miss (miss[b, j] = the
         slot). The hot pool holds host-format records, so both are left to the caller's gathers
         (sketchkv.ops.host_gather: from the GPU pool, and zero-copy from pinned host memory), which
         dequantise them into the scratch.
Sink and tail rows are copied from the resident rows (model dtype), rows past counts[b] from the
resident dump row (never read by attention). Hit and miss counts are added to `counters`
([hits, misses, ...], int64 on the device).

`write_resident` puts a step's new K/V into the resident rows (sinks, recent ring): both caches in one launch.

`compose_rows_ref` is the PyTorch formulation (~20 small kernels); `compose_rows_triton` does the
classification, the lookup and the resident copies in one kernel (one program per sequence and ROWS rows):
interpreter-tested against the reference, GPU-tested, the engine's default since H200 run 17
(SparseConfig.tier_kernel).
"""
import os

import torch

from sketchkv.kv.host_store import positions_to_slots

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SENTINEL = torch.iinfo(torch.int32).max


def compose_rows_ref(pos, counts, seq_lens, state_slots, block_tables, hot_map, hot_ref, res_k, res_v, counters,
                     *, sinks: int, recent: int, ring: int, width: int, block_size: int, dump_row: int, Np: int,
                     miss=None):
    """pos [B, N] ascending, SENTINEL-padded; hot_map [num_slots + 1] (the layer's; last entry: dump),
    hot_ref [P + 1] uint8, res_k / res_v [n_res, Hkv, D] (the resident rows; dump_row among them) ->
    k, v [B, Np, Hkv, D] (hit and miss rows not written), miss [B, Np] (host slot of each row to read
    from host memory, -1 elsewhere) and hit [B, Np] (hot pool row to read, -1 elsewhere). miss: an int64
    [B, Np] tensor to write the miss keys into (else a new one)."""
    B, N = pos.shape
    p = torch.nn.functional.pad(pos.long(), (0, Np - N), value=SENTINEL)
    dev = p.device
    valid = torch.arange(Np, device=dev)[None] < counts.long()[:, None]
    n = seq_lens.long()[:, None]
    sink = valid & (p < sinks)
    tail = valid & ~sink & (p >= torch.clamp(n - recent, min=sinks))
    pick = valid & ~sink & ~tail
    res = state_slots.long()[:, None] * width + torch.where(sink, p, sinks + p % ring)
    res = torch.where(sink | tail, res, dump_row)
    slots = positions_to_slots(block_tables, p, block_size, valid=pick)
    dump_key = hot_map.shape[0] - 1
    hot = hot_map[torch.where(slots >= 0, slots, dump_key)].long()
    hot = torch.where(slots >= 0, hot, -1)
    hit = hot >= 0
    hot_ref.index_fill_(0, torch.where(hit, hot, hot_ref.shape[0] - 1).flatten(), 1)
    counters[0] += hit.sum()
    counters[1] += (pick & ~hit).sum()
    keys = torch.where(pick & ~hit, slots, -1)
    miss = keys if miss is None else miss.copy_(keys)
    return res_k[res], res_v[res], miss, torch.where(hit, hot, -1)


if triton is not None:

    @triton.jit
    def _compose_rows_kernel(pos_ptr, counts_ptr, lens_ptr, sslot_ptr, bt_ptr, map_ptr, ref_ptr,
                             rk_ptr, rv_ptr, ok_ptr, ov_ptr, miss_ptr, hit_ptr, cnt_ptr,
                             N, Np, W, hot_dump, stride_pb, stride_btb,
                             SINKS: tl.constexpr, RECENT: tl.constexpr, RING: tl.constexpr, WIDTH: tl.constexpr,
                             BS: tl.constexpr, DUMP_ROW: tl.constexpr, HD: tl.constexpr, ROWS: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        inside = j < Np
        p = tl.load(pos_ptr + b * stride_pb + j, mask=j < N, other=2147483647).to(tl.int64)
        count = tl.load(counts_ptr + b)
        n = tl.load(lens_ptr + b).to(tl.int64)
        sslot = tl.load(sslot_ptr + b).to(tl.int64)
        valid = inside & (j < count)
        sink = valid & (p < SINKS)
        tail = valid & (p >= SINKS) & (p >= tl.maximum(n - RECENT, SINKS))
        pick = valid & (p >= SINKS) & (p < tl.maximum(n - RECENT, SINKS))
        res = tl.where(sink, sslot * WIDTH + p, sslot * WIDTH + SINKS + p % RING)
        res = tl.where(sink | tail, res, DUMP_ROW)
        blk_i = p // BS
        in_table = pick & (blk_i < W)
        blk = tl.load(bt_ptr + b * stride_btb + blk_i, mask=in_table, other=-1).to(tl.int64)
        has_slot = in_table & (blk >= 0)
        slot = blk * BS + p % BS
        hot = tl.load(map_ptr + slot, mask=has_slot, other=-1).to(tl.int64)
        hit = has_slot & (hot >= 0)
        miss = has_slot & (hot < 0)
        tl.store(ref_ptr + hot, tl.full([ROWS], 1, tl.uint8), mask=hit)
        tl.atomic_add(cnt_ptr, tl.sum(hit.to(tl.int64), 0))
        tl.atomic_add(cnt_ptr + 1, tl.sum(miss.to(tl.int64), 0))
        tl.store(miss_ptr + b * Np + j, tl.where(miss, slot, -1), mask=inside)
        tl.store(hit_ptr + b * Np + j, tl.where(hit, hot, -1), mask=inside)
        e = tl.arange(0, HD)
        m = (inside & ~miss & ~hit)[:, None]
        out = (b * Np + j).to(tl.int64)[:, None] * HD + e[None, :]
        tl.store(ok_ptr + out, tl.load(rk_ptr + res[:, None] * HD + e[None, :], mask=m), mask=m)
        tl.store(ov_ptr + out, tl.load(rv_ptr + res[:, None] * HD + e[None, :], mask=m), mask=m)


def compose_rows_triton(pos, counts, seq_lens, state_slots, block_tables, hot_map, hot_ref, res_k, res_v,
                        counters, *, sinks: int, recent: int, ring: int, width: int, block_size: int,
                        dump_row: int, Np: int, miss=None, rows_per_program: int = 16, num_warps: int = 4):
    """As compose_rows_ref (hit and miss rows are left for the caller's gathers)."""
    B, N = pos.shape
    Hkv, D = res_k.shape[1:]
    HD = Hkv * D
    assert HD & (HD - 1) == 0, "Hkv * head_dim must be a power of two"
    assert res_k.is_contiguous() and res_v.is_contiguous(), "one layer's rows: [rows, Hkv, D] contiguous"
    k = torch.empty(B, Np, Hkv, D, dtype=res_k.dtype, device=res_k.device)
    v = torch.empty_like(k)
    if miss is None:
        miss = torch.empty(B, Np, dtype=torch.int64, device=res_k.device)
    assert miss.shape == (B, Np) and miss.dtype == torch.int64 and miss.is_contiguous()   # the kernel's b * Np + j
    hit = torch.empty(B, Np, dtype=torch.int64, device=res_k.device)
    pos, tables = pos.contiguous(), block_tables.contiguous()
    grid = (B, triton.cdiv(Np, rows_per_program))
    _compose_rows_kernel[grid](pos, counts, seq_lens, state_slots, tables, hot_map, hot_ref, res_k, res_v,
                               k, v, miss, hit, counters, N, Np, tables.shape[1], hot_ref.shape[0] - 1,
                               pos.stride(0), tables.stride(0), SINKS=sinks, RECENT=recent, RING=ring, WIDTH=width,
                               BS=block_size, DUMP_ROW=dump_row, HD=HD, ROWS=rows_per_program,
                               num_warps=num_warps)
    return k, v, miss, hit


def compose_rows(pos, counts, seq_lens, state_slots, block_tables, hot_map, hot_ref, res_k, res_v, counters,
                 *, kernel: str = "torch", **kw):
    """kernel: "triton" (the engine's default; CUDA, or TRITON_INTERPRET=1) or "torch" (the reference)."""
    args = (pos, counts, seq_lens, state_slots, block_tables, hot_map, hot_ref, res_k, res_v, counters)
    if kernel == "triton" and triton is not None and (res_k.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return compose_rows_triton(*args, **kw)
    return compose_rows_ref(*args, **kw)


def write_resident_ref(res_k, res_v, rows, k, v) -> None:
    """res_k[rows[i]] = k[i] and res_v[rows[i]] = v[i] (rows [T] int64, every entry a valid row: tokens kept
    nowhere go to the dump row); k / v [T, Hkv, D] in any float dtype."""
    res_k.index_copy_(0, rows, k.to(res_k.dtype))
    res_v.index_copy_(0, rows, v.to(res_v.dtype))


if triton is not None:

    @triton.jit
    def _write_resident_kernel(k_ptr, v_ptr, rows_ptr, rk_ptr, rv_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                               HKV: tl.constexpr, D: tl.constexpr):
        t = tl.program_id(0)
        r = tl.load(rows_ptr + t).to(tl.int64)
        h = tl.arange(0, HKV)[:, None]
        d = tl.arange(0, D)[None, :]
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
        tl.store(rk_ptr + (r * HKV + h) * D + d, k.to(rk_ptr.dtype.element_ty))
        tl.store(rv_ptr + (r * HKV + h) * D + d, v.to(rv_ptr.dtype.element_ty))


def write_resident(res_k, res_v, rows, k, v) -> None:
    """See write_resident_ref: one Triton launch on CUDA (and under TRITON_INTERPRET=1) instead of two
    index_copy_ (Hkv and head_dim powers of two), the reference otherwise."""
    T, Hkv, D = k.shape
    pow2 = Hkv & (Hkv - 1) == 0 and D & (D - 1) == 0
    if triton is None or not pow2 or not (k.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return write_resident_ref(res_k, res_v, rows, k, v)
    assert res_k.is_contiguous() and res_v.is_contiguous() and k.stride(2) == v.stride(2) == 1
    if T:
        _write_resident_kernel[(T,)](k, v, rows, res_k, res_v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                     HKV=Hkv, D=D, num_warps=4)
