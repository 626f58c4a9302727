"""Host-RAM KV tier: quantised host rows, the zero-copy gather, the hot buffer's windowed CLOCK.

Kernels under TRITON_INTERPRET=1: as in test_ops_attention.py, the `test_interp_*` tests run only
where the kernels were built for the interpreter (hg._INTERPRETED); `test_interpreter_child` re-runs
them in a fresh `python -m pytest` child with TRITON_INTERPRET=1. GPU tests carry the `gpu` marker.
"""
import random

import pytest
import torch

from sketchkv.errors import CapacityError
from sketchkv.kv.host_store import HostKVStore, TierStats, positions_to_slots
from sketchkv.kv.hot_buffer import HotBuffer
from sketchkv.ops import host_gather as hg
from sketchkv.ops import quant_kv as qk
from sketchkv.ops.host_gather import (host_copy_rows, host_copy_rows_ref, host_gather, host_gather_ref, host_scatter_rows,
                                      host_scatter_rows_ref)
from conftest import run_interpreter_tests

needs_interp = pytest.mark.skipif(not hg._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_interpreter_child)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SENTINEL = torch.iinfo(torch.int32).max


def kv_like(shape, seed, spread=True):
    """Random K/V with per-vector magnitudes over a few decades, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:
        x = x * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    return x


# ---- formats and error bounds --------------------------------------------------------------------

def test_row_sizes():
    assert qk.head_record_bytes("int4", 256) == 272          # 128 + 128 codes + 4 + 4 fp16 scales
    assert qk.head_record_bytes("int8", 256) == 528          # 2 x 256 + 2 x 2, padded to 16
    assert qk.head_record_bytes("bf16", 256) == 1024
    assert qk.row_bytes("int4", 4, 256) == 1088 and qk.row_bytes("int8", 4, 256) == 2112
    assert qk.head_record_bytes("int4", 128) == 144          # 64 + 64 + 4 + 4 = 136 -> 144
    assert qk.head_record_bytes("int4", 32) == 48            # one group of 32 dims: 16 + 16 + 2 + 2 -> 48
    assert qk.head_record_bytes("k8v4", 256) == 400          # 256 + 128 + 2 + 4 x 2 = 394, padded to 16
    assert qk.row_bytes("k8v4", 4, 256) == 1600
    for fmt in qk.FORMATS:
        for D in (16, 32, 64, 128, 256):
            assert qk.head_record_bytes(fmt, D) % 16 == 0


@pytest.mark.parametrize("fmt", qk.FORMATS)
@pytest.mark.parametrize("D", [32, 64, 256])
def test_quantize_roundtrip_error_bound(fmt, D):
    k, v = kv_like((40, 3, D), seed=D), kv_like((40, 3, D), seed=D + 1) * 5
    rec = qk.pack_kv(k, v, fmt)
    assert rec.shape == (40, 3, qk.head_record_bytes(fmt, D)) and rec.dtype == torch.uint8
    kh, vh = qk.unpack_kv(rec, fmt, D)
    for part, x, xh in (("k", k, kh), ("v", v, vh)):
        err = (x - xh).abs()
        bound = qk.error_bound(x, fmt, part)
        assert (err <= bound * (1 + 1e-6) + 1e-30).all(), (err / bound).max()
        if fmt == "int4" or (fmt, part) == ("k8v4", "v"):  # relative to the group's max: s/2 = max|x|/14
            amax = x.unflatten(-1, (-1, qk.group_size(D))).abs().amax(-1).repeat_interleave(qk.group_size(D), -1)
            assert (err <= amax / 14 * (1 + 2 ** -10)).all()
            assert (err.amax(-1) > 0).all()  # it really is lossy (the bound is not vacuous)
        if fmt == "int8" or (fmt, part) == ("k8v4", "k"):
            assert (err <= x.abs().amax(-1, keepdim=True) / 254 * (1 + 2 ** -10)).all()


def test_quantize_edge_values():
    x = torch.zeros(2, 1, 64)
    x[1, 0, 5] = -3.0  # one non-zero element in a group: it round-trips exactly (code -7 x scale 3/7)
    for fmt in qk.FORMATS:
        kh, vh = qk.unpack_kv(qk.pack_kv(x, -x, fmt), fmt, 64)
        assert torch.equal(kh[0], x[0]) and torch.equal(vh[0], -x[0])  # all-zero -> exact zeros
        torch.testing.assert_close(kh[1], x[1], atol=3e-3, rtol=0)
    xb = kv_like((8, 2, 64), seed=3).to(torch.bfloat16)
    kh, _ = qk.unpack_kv(qk.pack_kv(xb, xb, "bf16"), "bf16", 64)
    assert torch.equal(kh, xb.float())  # bf16 cache -> bf16 host rows: lossless


def test_int4_packing_matches_sketch_convention():
    from sketchkv.ops.sketch import quantize_int4 as sketch_int4
    x = kv_like((16, 64), seed=7)
    p1, s1 = qk.quantize_int4(x)
    p2, s2 = sketch_int4(x)  # one group of 64 = the sketch's per-row scale
    assert torch.equal(p1, p2) and torch.equal(s1[:, 0], s2)


# ---- host store --------------------------------------------------------------------------------------

def make_store(fmt, L=2, num_blocks=7, bs=16, Hkv=2, D=64):
    return HostKVStore(L, num_blocks, bs, Hkv, D, fmt=fmt, pin=False, device="cpu")


def test_positions_to_slots():
    bt = torch.tensor([[3, 0, 5, -1], [2, 6, -1, -1]], dtype=torch.int32)
    pos = torch.tensor([[0, 17, 40, 47, SENTINEL, 70], [5, 16, 31, 32, -1, SENTINEL]], dtype=torch.int32)
    want = torch.tensor([[48, 1, 88, 95, -1, -1], [37, 96, 111, -1, -1, -1]])
    assert torch.equal(positions_to_slots(bt, pos, 16), want)
    assert torch.equal(positions_to_slots(bt, pos[:, None], 16), want[:, None])  # [B, Hsel, N]


@pytest.mark.parametrize("fmt", qk.FORMATS)
def test_store_roundtrip_through_blocks_and_sharing(fmt):
    store = make_store(fmt)
    bs, D = 16, 64
    assert store.row_bytes == 2 * qk.head_record_bytes(fmt, D)
    assert store.total_bytes == 2 * 7 * 16 * store.row_bytes
    assert store.bytes_per_block == 2 * 16 * store.row_bytes
    # sequence A: blocks [4, 1, 5], 40 tokens; sequence B shares A's first two blocks, then block 2
    bt = torch.tensor([[4, 1, 5], [4, 1, 2]], dtype=torch.int32)
    n_a, n_b = 40, 45
    ka, va = kv_like((2, n_a, 2, D), seed=1).unbind(0)
    kb_tail, vb_tail = kv_like((2, n_b - 32, 2, D), seed=2).unbind(0)
    for layer in range(2):
        sa = positions_to_slots(bt[:1], torch.arange(n_a)[None], bs)[0]
        store.write(layer, sa, ka * (layer + 1), va)
        sb = positions_to_slots(bt[1:], torch.arange(32, n_b)[None], bs)[0]   # B writes only its own block
        store.write(layer, sb, kb_tail, vb_tail * (layer + 1))
    for layer in range(2):
        ra = store.read_rows_ref(layer, positions_to_slots(bt[:1], torch.arange(n_a)[None], bs)[0])
        rb = store.read_rows_ref(layer, positions_to_slots(bt[1:], torch.arange(n_b)[None], bs)[0])
        want_a = qk.unpack_kv(qk.pack_kv(ka * (layer + 1), va, fmt), fmt, D)
        want_b = qk.unpack_kv(qk.pack_kv(kb_tail, vb_tail * (layer + 1), fmt), fmt, D)
        for got, want in zip(ra, want_a):
            assert torch.equal(got, want)  # exactly the quantised rows, at the right block and offset
        for i in range(2):
            assert torch.equal(rb[i][:32], ra[i][:32])      # shared blocks: same rows through either table
            assert torch.equal(rb[i][32:], want_b[i])
    # slot -1 is skipped; an overwrite replaces one row only
    before = store.rows(0).clone()
    slots = torch.tensor([-1, 4 * bs + 3])
    store.write(0, slots, torch.ones(2, 2, D), torch.ones(2, 2, D))
    changed = (store.rows(0) != before).any(-1).nonzero().flatten().tolist()
    assert changed == [4 * bs + 3]
    k1, v1 = store.read_rows_ref(0, torch.tensor([4 * bs + 3]))
    torch.testing.assert_close(k1, torch.ones(1, 2, D), atol=1e-3, rtol=0)
    torch.testing.assert_close(v1, torch.ones(1, 2, D), atol=1e-3, rtol=0)
    st = store.stats()
    assert st.pcie_write_bytes == (2 * (n_a + n_b - 32) + 1) * store.row_bytes and st.host_bytes == store.total_bytes


def test_store_rejects_unknown_format():
    with pytest.raises(ValueError):
        HostKVStore(1, 2, 16, 1, 64, fmt="fp8", pin=False)


def test_tier_stats_sum():
    a = TierStats(hits=3, misses=1, pcie_read_bytes=10, pcie_write_bytes=5, host_bytes=7, gpu_bytes=2)
    b = a + a
    assert (b.hits, b.misses, b.pcie_bytes, b.host_bytes) == (6, 2, 30, 14) and a.hit_rate == 0.75


# ---- gather: reference (CPU) --------------------------------------------------------------------------

def filled_store(fmt, Hkv, D, seed=0, L=1, num_blocks=9, bs=16):
    store = HostKVStore(L, num_blocks, bs, Hkv, D, fmt=fmt, pin=False, device="cpu")
    n = num_blocks * bs
    k, v = kv_like((2, n, Hkv, D), seed=seed).unbind(0)
    for layer in range(L):
        store.write(layer, torch.arange(n), k, v)
    return store


@pytest.mark.parametrize("fmt", qk.FORMATS)
def test_gather_ref_matches_store_rows(fmt):
    Hkv, D = 2, 64
    store = filled_store(fmt, Hkv, D)
    rows = torch.tensor([7, -1, 130, 3, 64, 7])
    dk = torch.full((6, Hkv, D), 9.0)
    dv = dk.clone()
    store.gather(0, rows, dk, dv)
    k, v = store.read_rows_ref(0, rows.clamp_min(0))
    keep = rows >= 0
    assert torch.equal(dk[keep], k[keep]) and torch.equal(dv[keep], v[keep])
    assert (dk[1] == 9).all()  # skipped entry untouched
    assert store.stats().pcie_read_bytes == 5 * store.row_bytes
    # per-KV-head picks: head h of row rows[h, i] -> dst[i, h]
    rows_h = torch.tensor([[1, 2, -1], [100, 2, 5]])
    dk = torch.zeros(3, Hkv, D)
    dv = torch.zeros(3, Hkv, D)
    store.gather(0, rows_h, dk, dv)
    for h in range(Hkv):
        for i, r in enumerate(rows_h[h].tolist()):
            if r >= 0:
                kr, vr = store.read_rows_ref(0, torch.tensor([r]))
                assert torch.equal(dk[i, h], kr[0, h]) and torch.equal(dv[i, h], vr[0, h])
    assert (dk[2, 0] == 0).all()
    assert store.stats().pcie_read_bytes == 5 * store.row_bytes + 5 * store.head_bytes


# ---- gather and scatter kernels under the interpreter --------------------------------------------

GATHER_CFGS = [  # (fmt, Hkv, D)
    ("int4", 2, 64), ("int4", 3, 128), ("int4", 4, 256), ("int4", 1, 32),
    ("int8", 2, 64), ("int8", 3, 128), ("int8", 1, 256),
    ("bf16", 2, 64), ("bf16", 1, 128), ("bf16", 4, 32),
    ("k8v4", 2, 64), ("k8v4", 4, 256), ("k8v4", 1, 32), ("k8v4", 3, 128),
]


@needs_interp
@pytest.mark.parametrize("fmt,Hkv,D", GATHER_CFGS)
@pytest.mark.parametrize("per_head", [False, True])
def test_interp_gather_kernel_vs_ref(fmt, Hkv, D, per_head):
    bs = 16
    store = filled_store(fmt, Hkv, D, seed=D + Hkv, num_blocks=9, bs=bs)
    g = torch.Generator().manual_seed(Hkv * D)
    # a sequence over shuffled blocks; picks unsorted, crossing block boundaries, with -1 holes
    bt = torch.randperm(9, generator=g)[None].int()
    n_picks = 37
    pos = torch.randperm(9 * bs, generator=g)[:n_picks]
    pos[[3, 20]] = SENTINEL
    slots = positions_to_slots(bt, pos[None], bs)[0]
    assert (slots == -1).sum() == 2 and len(set((slots[slots >= 0] // bs).tolist())) > 3
    if per_head:
        slots = torch.stack([slots.roll(h * 5) for h in range(Hkv)])
    M = n_picks + 11  # destination larger than the picks, rows scattered (hot-buffer-like)
    drows = torch.randperm(M, generator=g)[:n_picks].expand_as(slots).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        out = [torch.full((M, Hkv, D), float("nan"), dtype=dtype) for _ in range(2)]
        ref = [o.clone() for o in out]
        host_gather(store.rows(0), slots, *out, fmt, drows, rows_per_program=4)
        host_gather_ref(store.rows(0), slots, *ref, fmt, drows)
        for o, r in zip(out, ref):
            assert torch.equal(o.isnan(), r.isnan())  # the same rows written, nothing else
            if dtype == torch.float32:
                assert torch.equal(o.nan_to_num(), r.nan_to_num())  # both compute q * s in fp32
            else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds: 1 bf16 ulp
                torch.testing.assert_close(o.float().nan_to_num(), r.float().nan_to_num(), atol=1e-30, rtol=2 ** -7)
    # sorted picks (address order) give the same result
    out = [torch.zeros(M, Hkv, D) for _ in range(2)]
    srt = [torch.zeros(M, Hkv, D) for _ in range(2)]
    host_gather(store.rows(0), slots, *out, fmt, drows)
    host_gather(store.rows(0), slots, *srt, fmt, drows, sort=True)
    assert torch.equal(out[0], srt[0]) and torch.equal(out[1], srt[1])
    if slots.dim() == 1:   # sorted within each half (the tier: one segment per sequence)
        s, d = slots[:36], drows[:36]
        one, seg = [torch.zeros(M, Hkv, D) for _ in range(2)], [torch.zeros(M, Hkv, D) for _ in range(2)]
        host_gather(store.rows(0), s, *one, fmt, d)
        host_gather(store.rows(0), s, *seg, fmt, d, sort=True, segments=2)
        assert torch.equal(one[0], seg[0]) and torch.equal(one[1], seg[1])


@needs_interp
def test_interp_gather_kernel_row_tiles_and_empty():
    store = filled_store("int4", 2, 64)
    rows = torch.arange(143, -1, -1)[:100].contiguous()  # descending, many programs, ragged last tile
    for rpp, cap in ((1, None), (2, None), (16, None), (4, 3), (1, 1)):   # cap: programs looping over the tiles
        out = [torch.zeros(100, 2, 64) for _ in range(2)]
        ref = [torch.zeros(100, 2, 64) for _ in range(2)]
        host_gather(store.rows(0), rows, *out, "int4", rows_per_program=rpp, max_programs=cap)
        host_gather_ref(store.rows(0), rows, *ref, "int4")
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    e = [torch.zeros(0, 2, 64) for _ in range(2)]
    host_gather(store.rows(0), torch.zeros(0, dtype=torch.int64), *e, "int4")
    none = torch.full((8,), -1)
    z = [torch.zeros(8, 2, 64) for _ in range(2)]
    host_gather(store.rows(0), none, *z, "int4")
    assert (z[0] == 0).all()


RAW_CFGS = [("int4", 4, 64), ("int8", 2, 256), ("bf16", 3, 32), ("k8v4", 4, 256), ("k8v4", 2, 32)]


@pytest.mark.parametrize("fmt,Hkv,D", RAW_CFGS)
@pytest.mark.parametrize("sort", [False, True])
def test_gather_keeps_raw_records(fmt, Hkv, D, sort):
    _raw_records_case(fmt, Hkv, D, sort)


@needs_interp
@pytest.mark.parametrize("fmt,Hkv,D", RAW_CFGS)
@pytest.mark.parametrize("sort", [False, True])
def test_interp_gather_kernel_keeps_raw_records(fmt, Hkv, D, sort):
    _raw_records_case(fmt, Hkv, D, sort)


def _raw_records_case(fmt, Hkv, D, sort):
    """raw=: each pick's host record lands at its destination row as stored (the hot pool admits
    these), the dequantised rows are unchanged, skipped picks leave raw untouched; re-gathering from
    the copied records (the hot pool's read) gives the same K/V."""
    store = filled_store(fmt, Hkv, D, seed=3, num_blocks=9, bs=16)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, store.num_slots, (29,), generator=g)
    rows[[4, 17]] = -1
    M = 40
    drows = torch.randperm(M, generator=g)[:29]
    k0, v0 = torch.zeros(M, Hkv, D), torch.zeros(M, Hkv, D)
    host_gather_ref(store.rows(0), rows, k0, v0, fmt, drows)
    k, v = torch.zeros(M, Hkv, D), torch.zeros(M, Hkv, D)
    raw = torch.full((M, store.row_bytes), 0xAB, dtype=torch.uint8)
    host_gather(store.rows(0), rows, k, v, fmt, drows, raw=raw, sort=sort)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    ok = rows >= 0
    got, want = raw[drows[ok]], store.rows(0)[rows[ok]]
    # the head record's alignment padding (int4 at D = 64, int8) is not copied: compare what they decode to
    dec = [qk.unpack_kv(x.view(-1, Hkv, store.head_bytes), fmt, D) for x in (got, want)]
    assert all(torch.equal(a, b) for a, b in zip(*dec))
    skipped = torch.ones(M, dtype=torch.bool)
    skipped[drows[ok]] = False
    assert (raw[skipped] == 0xAB).all()
    k2, v2 = torch.zeros(M, Hkv, D), torch.zeros(M, Hkv, D)
    host_gather(raw, torch.where(skipped, -1, torch.arange(M)), k2, v2, fmt)
    assert torch.equal(k2, k0) and torch.equal(v2, v0)


@needs_interp
@pytest.mark.parametrize("fmt", qk.FORMATS)
def test_interp_store_write_kernel_roundtrip(fmt):
    # under the interpreter HostKVStore.write goes through the scatter kernel
    store = make_store(fmt, L=1, num_blocks=5, bs=16, Hkv=3, D=32)
    k, v = kv_like((2, 30, 3, 32), seed=5).unbind(0)
    slots = torch.randperm(80)[:30]
    slots[4] = -1
    store.write(0, slots, k, v)
    ok = slots >= 0
    got = store.read_rows_ref(0, slots[ok])
    want = qk.unpack_kv(qk.pack_kv(k[ok], v[ok], fmt), fmt, 32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert store.stats().pcie_write_bytes == 29 * store.row_bytes    # counted by the kernel
    dst = torch.zeros(20, 48, dtype=torch.uint8)
    src = torch.randint(0, 256, (6, 48), dtype=torch.uint8)
    s = torch.tensor([3, -1, 19, 0, 7, 11])
    c, c_ref = torch.tensor([5]), torch.tensor([5])    # counting bytes written onto what is there
    assert torch.equal(host_scatter_rows(dst.clone(), s, src, c), host_scatter_rows_ref(dst.clone(), s, src, c_ref))
    assert c.item() == c_ref.item() == 5 + 5 * 48


@needs_interp
@pytest.mark.parametrize("fmt", ["int4", "k8v4"])
@pytest.mark.parametrize("D", [256, 32])
def test_interp_pack_kernel_is_reference_bytes(D, fmt):
    """The record kernel (int4, and k8v4: int8 keys + int4 values) writes the reference's bytes (IEEE division,
    round half to even, fp16 scales), including exact ties, all-zero groups and strided heads."""
    k, v = kv_like((2, 9, 3, 2 * D), seed=7).unbind(0)
    k, v = k[..., :D] * 3, v[..., D:] * 1e-3
    k[0, 0] = 0
    s = (k[1, 1, :min(64, D)].abs().amax() / 7.0).half().float()
    k[1, 1, 5] = 2.5 * s                                        # an int4 tie: rounds to the even code 2
    s8 = (k[1, 2].abs().amax() / 127.0).half().float()
    k[1, 2, 7] = 3.5 * s8                                       # an int8 tie: rounds to the even code 4
    sv = (v[1, 1, :min(64, D)].abs().amax() / 7.0).half().float()
    v[1, 1, 3] = -1.5 * sv                                      # a value tie: -2
    dirty = torch.full((*k.shape[:2], qk.head_record_bytes(fmt, D)), 0xAB, dtype=torch.uint8)  # padding written too
    assert torch.equal(qk.pack_kv_triton(k, v, fmt, out=dirty), qk.pack_kv_ref(k, v, fmt))


# ---- hot buffer: windowed CLOCK -------------------------------------------------------------------

class SequentialClock:
    """One partition, one miss at a time: the semantics HotBuffer.admit batches (see its docstring)."""

    def __init__(self, cap, window):
        self.cap, self.W = cap, window
        self.keys, self.ref = [-1] * cap, [0] * cap
        self.hand = self.used = 0

    def lookup(self, key):
        if key in self.keys:
            self.ref[self.keys.index(key)] = 1
            return self.keys.index(key)
        return -1

    def admit(self, misses):
        out, used0, scanned = [], self.used, 0
        for key in misses:
            if self.used < self.cap:
                i = self.used
                self.used += 1
            else:
                i, cnt = None, 0
                while scanned < used0:  # at most one lap of the rows resident when the step began
                    s = self.hand
                    self.hand = (self.hand + 1) % self.cap
                    scanned += 1
                    cnt += 1
                    if self.ref[s] == 0 or cnt == self.W:
                        i = s
                        break
                    self.ref[s] = 0
                if i is None:
                    out.append(-1)
                    continue
            self.keys[i], self.ref[i] = key, 0
            out.append(i)
        return out


def hb_step(hb, layer, pids, keys_per_seq, src=None):
    """lookup + admit the misses for several sequences; returns (hits, placed) as lists of rows."""
    N = max(len(k) for k in keys_per_seq)
    keys = torch.full((len(pids), N), -1, dtype=torch.int64)
    for b, ks in enumerate(keys_per_seq):
        keys[b, :len(ks)] = torch.tensor(ks, dtype=torch.int64)
    rows = hb.lookup(layer, keys)
    miss = torch.where((rows < 0) & (keys >= 0), keys, -1)
    if src is None:
        src = torch.zeros(len(pids), N, *hb.row_shape)
    placed = hb.admit(layer, pids, miss, src)
    return rows, placed


def test_clock_exact_eviction_order():
    # cap 4, window 3: fills, hits protect, cold rows leave, the window's end is evicted when full
    hb = HotBuffer(1, 100, 8, (1, 16), torch.float32, window=3, min_rows=1)
    pid = hb.add_sequence(rows=4)
    base = hb._parts[pid][0]
    evicted = []

    def step(lookups, misses):
        key_at = {r: k for k, r in hb.resident(0, pid).items()}
        rows = hb.lookup(0, torch.tensor([lookups], dtype=torch.int64)) if lookups else None
        if rows is not None:
            assert (rows >= 0).all()
        placed = hb.admit(0, [pid], torch.tensor([misses], dtype=torch.int64), torch.zeros(1, len(misses), 1, 16))
        evicted.extend(key_at[r] for r in placed[0].tolist() if r in key_at)
        return [r - base if r >= 0 else -1 for r in placed[0].tolist()]

    assert step([], [10, 11, 12, 13]) == [0, 1, 2, 3]     # fill in row order
    assert step([11, 13], [20]) == [0]                    # hand at 0: row 0 (10) unreferenced -> out
    assert step([11], [21, 22]) == [2, 0]                 # skip 1 (ref, cleared), evict 12; skip 3, evict 20
    assert step([11, 21, 22, 13], [30]) == [3]            # rows 1,2,3 all referenced: the window's end (13)
    assert hb.ref[0, base].item() == 1                    # row 0 lies past the window: its bit survived
    assert step([], [31]) == [1]                          # row 0 referenced -> cleared; row 1 (11) cold -> out
    assert evicted == [10, 12, 20, 13, 11]
    assert hb.resident(0, pid) == {22: base, 31: base + 1, 21: base + 2, 30: base + 3}
    assert hb.hand[0, pid].item() == 2


def test_clock_hits_stay_cold_leave():
    hb = HotBuffer(1, 10_000, 64, (1, 16), torch.float32, window=4, min_rows=1)
    pid = hb.add_sequence(rows=8)
    hot = [1, 2, 3]
    next_key = 100
    for step in range(40):
        cold = list(range(next_key, next_key + 3))
        next_key += 3
        rows, _ = hb_step(hb, 0, [pid], [hot + cold])
        if step > 0:
            assert (rows[0, :3] >= 0).all(), step   # the hot rows stay resident
        res = hb.resident(0, pid)
        assert len(res) <= 8 and all(h in res for h in hot)
    assert not any(k in hb.resident(0, pid) for k in range(100, next_key - 6))  # old cold rows left


def test_clock_window_is_respected():
    # all rows referenced, window 3: the victim is the 3rd row from the hand, bits beyond stay set
    hb = HotBuffer(1, 1000, 16, (1, 16), torch.float32, window=3, min_rows=1)
    pid = hb.add_sequence(rows=8)
    hb_step(hb, 0, [pid], [list(range(8))])
    hb.lookup(0, torch.arange(8)[None])
    _, placed = hb_step(hb, 0, [pid], [[500]])
    assert placed.tolist() == [[2]]
    assert hb.ref[0, :8].tolist() == [0, 0, 0, 1, 1, 1, 1, 1] and hb.hand[0, pid].item() == 3
    _, placed = hb_step(hb, 0, [pid], [[501, 502]])
    # 501: rows 3, 4 referenced (cleared), 5 is the window's end -> evicted;
    # 502: rows 6, 7 referenced (cleared), row 0 (bit cleared in the step before) -> evicted
    assert placed.tolist() == [[5, 0]]
    assert hb.ref[0, :8].tolist() == [0, 0, 0, 0, 0, 0, 0, 0] and hb.hand[0, pid].item() == 1


def test_clock_one_lap_per_step_and_capacity():
    hb = HotBuffer(1, 1000, 16, (1, 16), torch.float32, window=2, min_rows=1)
    pid = hb.add_sequence(rows=4)
    _, placed = hb_step(hb, 0, [pid], [[1, 2, 3, 4, 5, 6]])
    assert placed.tolist() == [[0, 1, 2, 3, -1, -1]]  # more misses than rows: the extra are not admitted
    _, placed = hb_step(hb, 0, [pid], [[7, 8, 9, 10, 11]])
    assert placed.tolist() == [[0, 1, 2, 3, -1]]      # one lap: never evicts this step's own admits
    assert sorted(hb.resident(0, pid)) == [7, 8, 9, 10]
    assert hb.used[0, pid].item() == 4


@pytest.mark.parametrize("seed", range(6))
def test_clock_matches_sequential_reference(seed):
    _clock_vs_sequential(seed, "torch")


@needs_interp
@pytest.mark.parametrize("seed", range(4))
def test_interp_clock_admit_kernel_matches_sequential_reference(seed):
    """sketchkv/ops/clock_admit.py (one program per sequence) = the sequential CLOCK, like the PyTorch admit."""
    _clock_vs_sequential(seed, "triton")


def _clock_vs_sequential(seed, kernel):
    rnd = random.Random(seed)
    W = rnd.choice([1, 2, 3, 8])
    caps = [rnd.choice([3, 7, 16, 20]) for _ in range(3)]
    hb = HotBuffer(2, 10_000, sum(caps) + 5, (2, 16), torch.float32, window=W, min_rows=1, kernel=kernel)
    pids = [hb.add_sequence(rows=c) for c in caps]
    refs = [[SequentialClock(c, W) for c in caps] for _ in range(2)]
    universes = [list(range(1000 * (b + 1), 1000 * (b + 1) + 3 * caps[b])) for b in range(3)]
    for step in range(30):
        for layer in range(2):
            picks = [rnd.sample(u, rnd.randint(0, len(u) // 2)) for u in universes]
            N = max(1, max(len(p) for p in picks))
            keys = torch.full((3, N), -1, dtype=torch.int64)
            for b, p in enumerate(picks):
                keys[b, :len(p)] = torch.tensor(p, dtype=torch.int64)
            rows = hb.lookup(layer, keys)
            miss = torch.where((rows < 0) & (keys >= 0), keys, -1)
            src = torch.randn(3, N, 2, 16)
            if step % 2:  # pids as a device tensor (the graph-friendly form), capacity bound given
                placed = hb.admit(layer, torch.tensor(pids), miss, src, max_cap=max(caps) + step % 3)
            else:
                placed = hb.admit(layer, pids, miss, src)
            for b, (pid, ref) in enumerate(zip(pids, refs[layer])):
                base = hb._parts[pid][0]
                want_hits = [ref.lookup(k) for k in picks[b]]
                got_hits = [r - base if r >= 0 else -1 for r in rows[b, :len(picks[b])].tolist()]
                assert got_hits == want_hits, (step, layer, b)
                misses = [k for k, h in zip(picks[b], want_hits) if h < 0]
                want = ref.admit(misses)
                got = [r - base if r >= 0 else -1 for r, m in zip(placed[b].tolist(), miss[b].tolist()) if m >= 0]
                assert got == want, (step, layer, b, W)
                assert hb.ref[layer, base:base + caps[b]].tolist() == ref.ref
                assert hb.hand[layer, pid].item() == ref.hand and hb.used[layer, pid].item() == ref.used
                assert hb.resident(layer, pid) == {k: base + i for i, k in enumerate(ref.keys) if k >= 0}
                # the admitted rows carry their data
                for n, r in enumerate(placed[b].tolist()):
                    if r >= 0:
                        assert torch.equal(hb.rows[layer, r], src[b, n])
    assert hb.counters.snapshot()["hits"] > 0


def test_hot_buffer_shared_keys_dedup_and_lifecycle():
    _shared_keys_dedup_and_lifecycle("torch")


@needs_interp
def test_interp_clock_admit_kernel_shared_keys_and_lifecycle():
    _shared_keys_dedup_and_lifecycle("triton")


def _shared_keys_dedup_and_lifecycle(kernel):
    hb = HotBuffer(1, 1000, 20, (1, 16), torch.float32, window=4, min_rows=1, kernel=kernel)
    a, b = hb.add_sequence(rows=6), hb.add_sequence(rows=6)
    # both sequences miss key 7 (a prefix-shared block) and 8 twice: admitted once, by the first
    rows, placed = hb_step(hb, 0, [a, b], [[7, 8, 8], [7, 9]])
    assert placed.tolist() == [[0, 1, -1], [-1, 6, -1]]
    rows, _ = hb_step(hb, 0, [a, b], [[9], [7]])
    assert rows.tolist() == [[6], [0]]  # a hit in the other sequence's partition counts
    hb.remove_sequence(a)
    rows = hb.lookup(0, torch.tensor([[7, 8, 9]]))
    assert rows.tolist() == [[-1, -1, 6]]  # a's rows left the map, b's stay
    assert not hb.can_add(rows=14) and hb.can_add(rows=8)
    with pytest.raises(CapacityError):
        hb.add_sequence(rows=14)  # 14 rows free, but as 0..5 and 12..19: partitions are contiguous
    c = hb.add_sequence(rows=8)   # first fit: the tail
    assert hb._parts[c][0] == 12
    with pytest.raises(CapacityError):
        hb.add_sequence(rows=7)
    hb.remove_sequence(b)
    hb.remove_sequence(c)
    assert hb._free_ranges == [(0, 20)] and (hb.map == -1).all()
    assert (hb._claim == torch.iinfo(torch.int32).max).all()   # the dedup scratch is left clean
    d = hb.add_sequence(num_tokens=400)  # 2.5% of 400 tokens
    assert hb._parts[d] == (0, 10)
    assert hb.seq_bytes(d) == 10 * hb.row_bytes


@needs_interp
def test_interp_admit_candidates_kernel_keeps_first_non_resident_occurrence():
    from sketchkv.ops.clock_admit import admit_candidates_ref, admit_candidates_triton
    g = torch.Generator().manual_seed(5)
    S = 300
    keys = torch.randint(0, S, (3, 900), generator=g)           # 2,700 keys over 3 programs, many repeats
    keys[torch.rand(3, 900, generator=g) < 0.2] = -1
    hot_map = torch.full((S + 1,), -1, dtype=torch.int16)
    hot_map[torch.randperm(S, generator=g)[:100]] = 3           # resident keys
    claim = torch.full((S + 1,), torch.iinfo(torch.int32).max, dtype=torch.int32)
    out = admit_candidates_triton(keys, hot_map, claim)
    seen, want = set(), []
    for k in keys.flatten().tolist():
        first = k >= 0 and hot_map[k] < 0 and k not in seen
        seen.add(k)
        want.append(k if first else -1)
    assert out.flatten().tolist() == want
    assert (claim == torch.iinfo(torch.int32).max).all()
    assert torch.equal(admit_candidates_ref(keys, hot_map, claim), out)
    assert (claim == torch.iinfo(torch.int32).max).all()


def test_hot_buffer_invalidate():
    hb = HotBuffer(2, 1000, 8, (1, 16), torch.float32, window=2, min_rows=1)
    p = hb.add_sequence(rows=4)
    for layer in range(2):
        hb_step(hb, layer, [p], [[5, 6]])
    hb.invalidate(torch.tensor([5]))
    for layer in range(2):
        rows, placed = hb_step(hb, layer, [p], [[5, 6]])
        assert rows.tolist() == [[-1, 1]] and placed.tolist() == [[2, -1]]  # re-admitted into a new row
    st = hb.stats()
    assert st.hits == 2 and st.misses == 6 and st.gpu_bytes == hb.gpu_bytes


# ---- GPU (H200) --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4", "k8v4"])
def test_gpu_pack_kernel_is_reference_bytes(fmt):
    k, v = kv_like((2, 64, 4, 256), seed=8).unbind(0)
    k, v = (k * 4).cuda().bfloat16(), v.cuda().bfloat16()
    assert torch.equal(qk.pack_kv_triton(k, v, fmt), qk.pack_kv_ref(k, v, fmt))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", qk.FORMATS)
def test_gpu_gather_from_pinned_1gib(fmt):
    """27B shape (4 KV heads x 256) over ~1 GiB of pinned rows written through the UVA scatter: the gather (shared
    picks, sorted or not, capped grid; per-head picks) and the whole-row copy against the references."""
    Hkv, D, bs = 4, 256, 64
    rb = qk.row_bytes(fmt, Hkv, D)
    num_blocks = (2 ** 30 // rb) // bs
    store = HostKVStore(1, num_blocks, bs, Hkv, D, fmt=fmt, device="cuda")
    assert store.buf.is_pinned() and store.total_bytes <= 2 ** 30
    n = store.num_slots
    written = torch.randperm(n, device="cuda")[:65536]
    k = torch.randn(65536, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    store.write(0, written, k, v)
    # cap: the grid at 66 programs looping over their tiles (the tier's read groups: half an H100's / H200's SMs)
    for N, sort, cap in ((16384, False, None), (16384, True, None), (131072, True, None), (131072, False, 66)):
        picks = written[torch.randint(0, 65536, (N,), device="cuda")]
        picks[::97] = -1
        dk = torch.zeros(N, Hkv, D, device="cuda", dtype=torch.bfloat16)
        dv = torch.zeros_like(dk)
        store.gather(0, picks, dk, dv, sort=sort, max_programs=cap)
        ok = (picks >= 0).cpu()
        rk, rv = store.read_rows_ref(0, picks.clamp_min(0).cpu())
        torch.testing.assert_close(dk.cpu()[ok].float(), rk[ok].to(torch.bfloat16).float(), atol=0, rtol=2 ** -8)
        torch.testing.assert_close(dv.cpu()[ok].float(), rv[ok].to(torch.bfloat16).float(), atol=0, rtol=2 ** -8)
        assert (dk.cpu()[~ok] == 0).all()
    # whole rows as stored (sparse miss_read="rows"), full and capped grid: byte for byte; -1 rows untouched
    picks = written[torch.randint(0, 65536, (131072,), device="cuda")]
    picks[::97] = -1
    want = host_copy_rows_ref(store.rows(0), picks.cpu(), torch.full((131072, rb), 5, dtype=torch.uint8))
    for cap in (None, 66):
        got = store.copy_rows(0, picks, torch.full((131072, rb), 5, dtype=torch.uint8, device="cuda"), max_programs=cap)
        assert torch.equal(got.cpu(), want)
    # per-KV-head picks
    picks = torch.stack([written[torch.randint(0, 65536, (4096,), device="cuda")] for _ in range(Hkv)])
    dk = torch.zeros(4096, Hkv, D, device="cuda")
    dv = torch.zeros_like(dk)
    store.gather(0, picks, dk, dv)
    for h in range(Hkv):
        rk, _ = store.read_rows_ref(0, picks[h].cpu())
        torch.testing.assert_close(dk[:, h].cpu(), rk[:, h], atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_step_has_no_host_sync_and_matches_cpu():
    """lookup / gather / admit / write: no host sync (sync debug mode = error); same state as CPU."""
    Hkv, D, bs, L = 2, 128, 64, 2
    store = HostKVStore(L, 64, bs, Hkv, D, fmt="int4", device="cuda")
    k = torch.randn(64 * bs, Hkv, D, device="cuda")
    for layer in range(L):
        store.write(layer, torch.arange(64 * bs, device="cuda"), k, k)
    hbs = [HotBuffer(L, store.num_slots, 64, (store.row_bytes,), torch.uint8, dev, window=4, min_rows=1)
           for dev in ("cuda", "cpu")]
    pids = [[hb.add_sequence(rows=24), hb.add_sequence(rows=30)] for hb in hbs]
    pid_t = torch.tensor(pids[0], device="cuda")
    five = torch.tensor([5], device="cuda")
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        keys = torch.stack([torch.randperm(400, generator=g)[:48] + 400 * b for b in range(2)])
        for layer in range(L):
            outs = []
            for hb, p, dev in zip(hbs, (pid_t, pids[1]), ("cuda", "cpu")):
                kk = keys.to(dev)
                if dev == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    rows = hb.lookup(layer, kk)
                    miss = torch.where(rows < 0, kk, -1)
                    sk = torch.zeros(2 * 48, Hkv, D, device=dev, dtype=torch.bfloat16)
                    sv = torch.zeros_like(sk)
                    rec = torch.zeros(2 * 48, store.row_bytes, device=dev, dtype=torch.uint8)
                    if dev == "cuda":
                        store.gather(layer, miss.flatten(), sk, sv, sort=True, segments=2, raw=rec)   # as HostTier
                        store.write(layer, five, k[5:6], k[5:6])  # same bytes: the CPU side reads them too
                    else:
                        host_gather_ref(store.rows(layer), miss.flatten().cpu(), sk, sv, "int4", raw=rec)
                    placed = hb.admit(layer, p, miss, rec.view(2, 48, -1), max_cap=30)
                finally:
                    if dev == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
                outs.append((rows.cpu(), placed.cpu()))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # the dump row (last) absorbs masked writes in any order (GPU index_put with duplicates): not state
    assert torch.equal(hbs[0].rows[:, :-1].cpu(), hbs[1].rows[:, :-1]) and torch.equal(hbs[0].ref.cpu(), hbs[1].ref)
    assert (hbs[1].rows[:, :-1] != 0).any()


# ---- the scratch composition kernel (ops/tier_gather.py) under the interpreter ------------------------

def _compose_case(map_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, N, bs, S, R, P, Hkv, D = 3, 40, 16, 4, 8, 50, 2, 16
    n_state, width = 4, S + R
    n_res = n_state * width + 1
    lens = torch.tensor([300, 37, 120], dtype=torch.int32)
    tables = torch.randperm(64, generator=g)[:60].view(3, 20).int()
    pos = torch.full((B, N), SENTINEL, dtype=torch.int32)
    counts = torch.tensor([40, 20, 33], dtype=torch.int32)
    for b in range(B):
        n = int(lens[b])
        picks = torch.randperm(max(1, n - S - R), generator=g)[: int(counts[b]) - 6] + S
        chosen = torch.cat([torch.arange(2), picks, torch.arange(n - 4, n)]).unique().sort().values
        counts[b] = len(chosen)
        pos[b, : len(chosen)] = chosen.int()
    slots_total = 64 * bs
    hot_map = torch.full((slots_total + 1,), -1, dtype=map_dtype)
    hot_slots = torch.randperm(slots_total, generator=g)[:400]
    hot_map[hot_slots] = torch.randint(0, P, (400,), generator=g).to(map_dtype)
    res_k = torch.randn(n_res, Hkv, D, generator=g)
    res_v = torch.randn(n_res, Hkv, D, generator=g)
    state_slots = torch.tensor([2, 0, 3])
    kw = dict(sinks=S, recent=R, ring=R, width=width, block_size=bs, dump_row=n_res - 1, Np=48)
    return (pos, counts, lens, state_slots, tables, hot_map), (res_k, res_v), P, kw


@needs_interp
@pytest.mark.parametrize("map_dtype", [torch.int16, torch.int32])
def test_interp_compose_rows_kernel_vs_ref(map_dtype):
    """The fused scratch composition = the PyTorch reference: miss keys, hit pool rows, every other row
    (sinks and recent ring from the resident rows, padding from the dump row), the reference bits of
    the hits, the hit / miss counters."""
    from sketchkv.ops.tier_gather import compose_rows_ref, compose_rows_triton
    sel, (rk, rv), P, kw = _compose_case(map_dtype)
    outs = []
    for fn in (compose_rows_ref, compose_rows_triton):
        ref_bits = torch.zeros(P + 1, dtype=torch.uint8)
        counters = torch.zeros(4, dtype=torch.int64)
        k, v, miss, hit = fn(*sel, ref_bits, rk, rv, counters, **kw)
        outs.append((k, v, miss, hit, ref_bits, counters))
    (k0, v0, m0, h0, r0, c0), (k1, v1, m1, h1, r1, c1) = outs
    assert torch.equal(m0, m1) and (m0 >= 0).any() and (m0 < 0).any()
    assert torch.equal(h0, h1) and (h0 >= 0).any() and not ((h0 >= 0) & (m0 >= 0)).any()
    assert torch.equal(r0[h0[h0 >= 0]], torch.ones(int((h0 >= 0).sum()), dtype=torch.uint8))
    keep = (m0 < 0) & (h0 < 0)
    assert torch.equal(k0[keep], k1[keep]) and torch.equal(v0[keep], v1[keep])
    assert torch.equal(r0[:P], r1[:P]) and r0.sum() > 0
    assert torch.equal(c0, c1) and c0[0] == (h0 >= 0).sum() and c0[1] == (m0 >= 0).sum()


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_write_resident_kernel_vs_ref(dtype):
    """A step's new K/V into the resident rows (k / v strided views, as from a fused projection) = two
    index_copy_, bitwise."""
    from sketchkv.ops.tier_gather import write_resident, write_resident_ref
    g = torch.Generator().manual_seed(9)
    kv = torch.randn(5, 2, 4, 32, generator=g).to(dtype)       # [T, k|v, Hkv, D]: strided views
    k, v = kv[:, 0], kv[:, 1]
    rows = torch.tensor([3, 0, 7, 9, 6])
    want = [torch.randn(10, 4, 32, generator=g) for _ in range(2)]
    got = [x.clone() for x in want]
    write_resident_ref(*want, rows, k, v)
    write_resident(*got, rows, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][rows], k.float()) and torch.equal(got[1][rows], v.float())


# ---- interpreter child -------------------------------------------------------------------------------

def test_interpreter_child():
    run_interpreter_tests(__file__, hg._INTERPRETED)


def test_bench_host_gather_smoke(tmp_path):
    """benchmarks/bench_host_gather.py --smoke (CPU, interpreter child): every gather case in all three pick
    orders matches the reference, and the hot-buffer step runs (the GPU run's script, kept runnable)."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "hg.json"
    r = subprocess.run([sys.executable, "benchmarks/bench_host_gather.py", "--smoke", "--footprints-mib", "--out",
                        str(out)], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    orders = {(g["case"], g["order"]) for g in res["gather"]}
    assert len(orders) == 3 * len({g["case"] for g in res["gather"]}) and all(g["exact_vs_ref"] for g in res["gather"])
    assert res["hot_buffer_step"]["us"] > 0 and 0 < res["hot_buffer_step"]["hit_rate"] < 1


@needs_interp
@pytest.mark.parametrize("fmt,Hkv", [("int4", 4), ("bf16", 2), ("int8", 1)])
def test_interp_copy_rows_vs_ref(fmt, Hkv):
    """host_copy_rows under the interpreter: the picked rows byte for byte (-1 skipped, those rows untouched), with a
    capped grid too; then host_gather from the copies gives what host_gather from the host rows gives."""
    store = filled_store(fmt, Hkv, 32, seed=5, num_blocks=6, bs=16)
    src = store.rows(0)
    g = torch.Generator().manual_seed(3)
    rows = torch.randperm(src.shape[0], generator=g)[:45].int()
    rows[[0, 17, 44]] = -1
    want = host_copy_rows_ref(src, rows, torch.full((45, src.shape[1]), 7, dtype=torch.uint8))
    for cap in (None, 2):
        got = host_copy_rows(src, rows, torch.full((45, src.shape[1]), 7, dtype=torch.uint8), rows_per_program=4,
                             max_programs=cap)
        assert torch.equal(got, want)
    assert (want[[0, 17, 44]] == 7).all() and torch.equal(want[1], src[rows[1]])
    local = torch.where(rows >= 0, torch.arange(45, dtype=torch.int32), -1)
    a = [torch.zeros(45, Hkv, 32) for _ in range(2)]
    b = [torch.zeros(45, Hkv, 32) for _ in range(2)]
    host_gather(src, rows, *a, fmt)
    host_gather(want, local, *b, fmt)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
