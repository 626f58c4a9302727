"""Attention ops: paged decode (reference + Triton kernel) and prefix-causal prefill.

TRITON_INTERPRET: triton decides interpreter vs compiler when a kernel is *decorated*, i.e. when
sketchkv.ops.paged_attention is first imported, so flipping os.environ inside a shared pytest process
is unreliable (another test file may have imported the module first). The `test_interp_*` tests
therefore run only where the kernels were built for the interpreter (pa._INTERPRETED), and
`test_interpreter_child` re-runs them in a fresh `python -m pytest` child with TRITON_INTERPRET=1.
If the whole suite is started with TRITON_INTERPRET=1 they run in-process and the child is skipped.
"""

import pytest
import torch

from sketchkv.ops import paged_attention as pa
from sketchkv.ops.paged_attention import gather_kv, paged_attention_decode, paged_attention_decode_ref
from sketchkv.ops.prefill_attention import _masked_attention, prefix_causal_attention, prefix_causal_attention_ref
from conftest import run_interpreter_tests

needs_interp = pytest.mark.skipif(not pa._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_interpreter_child)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_paged(seq_lens, Hkv, D, block_size, dtype, device="cpu", seed=0):
    """Random dense K/V per sequence, scattered into a paged cache through shuffled block ids.

    The caches are strided views (k and v interleaved in one buffer) and the block table is a
    column slice of a wider tensor, so the kernel's stride handling is exercised.
    """
    g = torch.Generator().manual_seed(seed)
    nblk = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(nblk) + 3  # a few unused blocks
    kv = torch.randn(num_blocks, 2, block_size, Hkv, D, generator=g).to(dtype).to(device)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(nblk) + 2  # -1 padding past every sequence's end
    wide = torch.full((len(seq_lens), max_blocks + 5), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(nblk):
        wide[b, 1:1 + n] = perm[i:i + n].int()
        i += n
    block_tables = wide.to(device)[:, 1:1 + max_blocks]
    dense = [gather_kv(k_cache, v_cache, block_tables[b], n) for b, n in enumerate(seq_lens)]
    return k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=device), dense


def rel_err_rows(out, ref):
    """Per-(row, head) relative L2 error, robust to the tiny magnitudes of long flat softmaxes."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()


# --- reference decode vs an independent dense attention -------------------------------------------

def test_gather_kv_roundtrip():
    seq_lens = [1, 17, 40]
    k_cache, v_cache, bt, _, _ = make_paged(seq_lens, 2, 16, 16, torch.float32)
    for b, n in enumerate(seq_lens):
        k, v = gather_kv(k_cache, v_cache, bt[b], n)
        assert k.shape == (n, 2, 16)
        for t in range(n):
            blk, off = bt[b, t // 16].item(), t % 16
            assert torch.equal(k[t], k_cache[blk, off]) and torch.equal(v[t], v_cache[blk, off])


@pytest.mark.parametrize("G", [1, 4, 6])
def test_decode_ref_vs_dense(G):
    Hkv, D, bs = 2, 32, 16
    seq_lens = [1, 23, 70]
    k_cache, v_cache, bt, lens, dense = make_paged(seq_lens, Hkv, D, bs, torch.float32)
    q = torch.randn(len(seq_lens), G * Hkv, D)
    scale = D ** -0.5
    out = paged_attention_decode_ref(q, k_cache, v_cache, bt, lens, scale)
    for b, (k, v) in enumerate(dense):
        for h in range(G * Hkv):
            kh, vh = k[:, h // G].double(), v[:, h // G].double()
            w = torch.softmax(kh @ q[b, h].double() * scale, 0)
            torch.testing.assert_close(out[b, h].double(), w @ vh, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(pa._INTERPRETED, reason="interpreted process dispatches to the kernel")
def test_decode_cpu_dispatch_is_ref():
    k_cache, v_cache, bt, lens, _ = make_paged([5, 33], 1, 16, 16, torch.float32)
    q = torch.randn(2, 2, 16)
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, bt, lens, 0.25, out=out)
    assert torch.equal(out, paged_attention_decode_ref(q, k_cache, v_cache, bt, lens, 0.25))


# --- Triton decode kernel under the interpreter ---------------------------------------------------

@pytest.fixture
def nan_empty(monkeypatch):
    """Poison every float torch.empty (the kernel's split buffers) so unwritten entries show as NaN."""
    empty = torch.empty

    def poisoned(*a, **kw):
        t = empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)


DECODE_CFGS = [  # (G, Hkv, D, block_size, dtype, kernel knobs)
    (1, 2, 64, 16, torch.float32, {}),
    (4, 2, 128, 64, torch.float32, {"block_n": 16, "min_split_tokens": 16}),  # many splits per sequence
    (6, 1, 64, 64, torch.float32, {"max_splits": 3, "block_n": 16, "min_split_tokens": 16}),  # capped, re-spread
    (4, 1, 256, 16, torch.float32, {"max_splits": 1}),  # single split, head_dim 256
    (6, 2, 128, 16, torch.bfloat16, {"block_n": 32, "min_split_tokens": 32, "split_target": 2}),
    (1, 1, 16, 16, torch.bfloat16, {}),
]


@needs_interp
@pytest.mark.parametrize("G,Hkv,D,bs,dtype,kw", DECODE_CFGS)
def test_interp_decode_kernel_vs_ref(G, Hkv, D, bs, dtype, kw, nan_empty):
    seq_lens = [1, 37, 150]  # includes 1 and lengths that are not multiples of the block size
    k_cache, v_cache, bt, lens, _ = make_paged(seq_lens, Hkv, D, bs, dtype, seed=G * D + bs)
    q = torch.randn(len(seq_lens), G * Hkv, D).to(dtype)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, bt, lens, scale, out=out, **kw)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, lens, scale)
    assert not out.isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: both sides round the same fp32 to bf16 (1 ulp = 2^-8)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_interp
def test_interp_decode_kernel_zero_len_padding(nan_empty):
    # CUDA-graph batches are padded with seq_len 0 rows (block table all -1): they must give 0, not NaN
    k_cache, v_cache, bt, lens, _ = make_paged([70, 1], 2, 32, 16, torch.float32)
    bt[1] = -1
    lens[1] = 0
    q = torch.randn(2, 4, 32)
    out = paged_attention_decode(q, k_cache, v_cache, bt, lens, 0.2, block_n=16, min_split_tokens=16)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, lens, 0.2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_interp
@pytest.mark.parametrize("seq_lens", [[300], [2, 3, 200, 17, 1]])
def test_interp_decode_kernel_batch_shapes(seq_lens, nan_empty):
    # B=1 (B_PAD=1) and a long sequence among short ones (it takes most of the split budget)
    k_cache, v_cache, bt, lens, _ = make_paged(seq_lens, 1, 32, 16, torch.float32, seed=len(seq_lens))
    q = torch.randn(len(seq_lens), 2, 32)
    out = paged_attention_decode(q, k_cache, v_cache, bt, lens, 0.2, block_n=16, min_split_tokens=16)
    torch.testing.assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, bt, lens, 0.2), atol=1e-4, rtol=1e-4)


def grouped_rows(lens_last, rows_per_group, device="cpu"):
    """Query rows in groups (a sequence's verification rows): group g's rows attend to the first
    lens_last[g] - (rows - 1 - i) tokens of its list -> (row_groups, per-row lengths)."""
    firsts, lasts, group, lens = [], [], [], []
    for g, (n, m) in enumerate(zip(lens_last, rows_per_group)):
        firsts.append(len(lens))
        lens += [max(1, n - (m - 1 - i)) for i in range(m)]
        group += [g] * m
        lasts.append(len(lens) - 1)
    t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)
    return (t(firsts), t(lasts), t(group), max(rows_per_group)), t(lens, torch.int32)


@needs_interp
@pytest.mark.parametrize("indexed", [False, True])
def test_interp_decode_kernel_row_groups(indexed, nan_empty):
    """Rows in groups reading one token list each (K/V tiles loaded once per group) == every row on its
    own with its group's list (the reference, and the ungrouped kernel)."""
    lens_last, per_group = [150, 1, 37, 70], [4, 1, 3, 4]   # a one-token group; groups of fewer rows
    k_cache, v_cache, bt, _, _ = make_paged(lens_last, 2, 32, 16, torch.float32, seed=3)
    groups, lens = grouped_rows(lens_last, per_group)
    q = torch.randn(lens.shape[0], 6 * 2, 32)
    kw = dict(block_n=16, min_split_tokens=16)
    if indexed:   # ascending picks of each group's tokens; a row reads a prefix of them
        idx = torch.full((len(lens_last), 1, 160), 2**31 - 1, dtype=torch.int32)
        for g, n in enumerate(lens_last):
            idx[g, 0, :n] = torch.arange(n, dtype=torch.int32)
        from sketchkv.ops.sparse_attention import sparse_attention, sparse_attention_ref
        out = sparse_attention(q, k_cache, v_cache, bt, idx, lens, 0.2, row_groups=groups)
        ref = sparse_attention_ref(q, k_cache, v_cache, bt[groups[2]], idx[groups[2]], lens, 0.2)
    else:
        out = torch.full_like(q, float("nan"))
        paged_attention_decode(q, k_cache, v_cache, bt, lens, 0.2, out=out, row_groups=groups, **kw)
        ref = paged_attention_decode_ref(q, k_cache, v_cache, bt[groups[2]], lens, 0.2)
        alone = paged_attention_decode(q, k_cache, v_cache, bt[groups[2]].contiguous(), lens, 0.2, **kw)
        torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_interp
@pytest.mark.parametrize("grouped", [False, True])
def test_interp_decode_kernel_own_blocks(grouped, nan_empty):
    """block_tables=None (row b's blocks are b * nb + j: the host tier's compact scratch) == the same layout
    through an explicit table, bitwise, and == the reference (which builds that table)."""
    B, nb, bs, Hkv, D = (3, 4, 16, 2, 32)
    g = torch.Generator().manual_seed(11)
    k_cache = torch.randn(B * nb, bs, Hkv, D, generator=g)
    v_cache = torch.randn(B * nb, bs, Hkv, D, generator=g)
    table = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
    if grouped:
        groups, lens = grouped_rows([60, 1, 33], [2, 1, 3])
    else:
        groups, lens = None, torch.tensor([60, 1, 33], dtype=torch.int32)
    q = torch.randn(lens.shape[0], 3 * Hkv, D, generator=g)
    kw = dict(block_n=16, min_split_tokens=16, row_groups=groups)
    out = paged_attention_decode(q, k_cache, v_cache, None, lens, 0.2, **kw)
    assert torch.equal(out, paged_attention_decode(q, k_cache, v_cache, table, lens, 0.2, **kw))
    rows = table if groups is None else table[groups[2]]
    torch.testing.assert_close(out, paged_attention_decode_ref(q, k_cache, v_cache, rows, lens, 0.2),
                               atol=1e-4, rtol=1e-4)


def key_base_case(B, nb, bs, Hkv, D, r, dtype, device="cpu", seed=0):
    """The host tier's compact K/V scratch (row b: blocks b * nb ..) holding residual keys (k - sketch base) where a
    row came from host records (a miss: its slot; a hot hit: its pool row's slot) and whole keys elsewhere (resident
    rows), with the sketch arrays -> (k residual, v, key_base tuple, k completed in fp32)."""
    from sketchkv.ops.sketch import sketch_keys_ref
    from sketchkv.ops.sketch_base import row_slots, sketch_base_ref
    g = torch.Generator().manual_seed(seed)
    n_slots, rows = 64 * Hkv, B * nb * bs
    basis = torch.linalg.qr(torch.randn(Hkv, D, D, generator=g))[0][..., :r].contiguous()
    mean = torch.randn(Hkv, D, generator=g)
    sk, sc = sketch_keys_ref(torch.randn(n_slots, Hkv, D, generator=g) * 3 + mean, mean, basis)
    miss = torch.randint(-1, n_slots, (rows,), generator=g)
    pool_slots = torch.randint(0, n_slots, (40,), generator=g)
    pool_slots[-1] = -1                                                   # the pool's dump row
    hit = torch.where(miss < 0, torch.randint(-1, 40, (rows,), generator=g), -1)
    base = sketch_base_ref(row_slots(miss, hit, pool_slots), sk, sc, mean, basis)
    k_full = torch.randn(rows, Hkv, D, generator=g) * 2 + base
    k_res = (k_full - base).to(dtype)
    k_done = k_res.float() + base
    v = torch.randn(rows, Hkv, D, generator=g).to(dtype)
    to = lambda x: x.to(device)   # noqa: E731
    kb = tuple(map(to, (miss, hit, pool_slots, sk.contiguous(), sc.contiguous(), mean, basis)))
    shape = (B * nb, bs, Hkv, D)
    return to(k_res).view(shape), to(v).view(shape), kb, to(k_done).view(shape)


@needs_interp
@pytest.mark.parametrize("grouped", [False, True])
def test_interp_decode_kernel_key_base(grouped, nan_empty):
    """key_base: the residual keys' sketch base added inside the scores == attention over the keys completed first
    (fp32 reference), within what rounding those keys to bf16 (the rewrite's scratch on a GPU) costs: the kernel
    takes basis^T q in fp16 for the tensor cores; resident rows (no slot) unchanged; grouped rows too."""
    B, nb, bs, Hkv, D, r = 3, 4, 16, 2, 32, 16
    k, v, kb, k_done = key_base_case(B, nb, bs, Hkv, D, r, torch.float32, seed=5)
    if grouped:
        groups, lens = grouped_rows([60, 1, 33], [2, 1, 3])
    else:
        groups, lens = None, torch.tensor([60, 1, 33], dtype=torch.int32)
    q = torch.randn(lens.shape[0], 3 * Hkv, D, generator=torch.Generator().manual_seed(6))
    kw = dict(block_n=16, min_split_tokens=16, row_groups=groups)
    out = paged_attention_decode(q, k, v, None, lens, 0.2, key_base=kb, **kw)
    want = paged_attention_decode(q, k_done, v, None, lens, 0.2, **kw)
    rewrite = paged_attention_decode(q, k_done.bfloat16().float(), v, None, lens, 0.2, **kw)
    assert 0 < rel_err_rows(out, want) < rel_err_rows(rewrite, want)
    assert rel_err_rows(paged_attention_decode(q, k, v, None, lens, 0.2, **kw), want) > 1e-2   # the base matters


@pytest.mark.skipif(pa._INTERPRETED, reason="interpreted process dispatches to the kernel")
def test_decode_key_base_reference_path():
    """Without Triton (plain CPU) key_base completes the keys by ops.sketch_base, then the reference."""
    k, v, kb, k_done = key_base_case(2, 2, 16, 2, 32, 8, torch.bfloat16, seed=7)
    lens = torch.tensor([32, 17], dtype=torch.int32)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = paged_attention_decode(q, k, v, None, lens, 0.2, key_base=kb)
    want = paged_attention_decode(q, k_done, v.float(), None, lens, 0.2)
    torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_interpreter_child():
    run_interpreter_tests(__file__, pa._INTERPRETED)



# --- prefill with a cached prefix (CPU) -----------------------------------------------------------

def dense_prefix_causal(q, k, v, scale):
    """Independent per-query loop: query i at position P + i sees keys 0..P+i."""
    Lq, Hq, D = q.shape
    Lk, Hkv, _ = k.shape
    G, P = Hq // Hkv, Lk - Lq
    out = torch.empty(Lq, Hq, D, dtype=torch.float64)
    for i in range(Lq):
        kk, vv = k[: P + i + 1].double(), v[: P + i + 1].double()
        for h in range(Hq):
            w = torch.softmax(kk[:, h // G] @ q[i, h].double() * scale, 0)
            out[i, h] = w @ vv[:, h // G]
    return out


PREFILL_CFGS = [  # (Lq, prefix, Hq, Hkv, D)
    (37, 0, 4, 4, 64),
    (37, 0, 8, 2, 64),
    (20, 45, 6, 1, 128),
    (64, 100, 8, 2, 64),
    (1, 50, 4, 2, 32),
]


def test_prefill_ref_vs_dense():
    q, k, v = torch.randn(13, 6, 32), torch.randn(30, 2, 32), torch.randn(30, 2, 32)
    torch.testing.assert_close(prefix_causal_attention_ref(q, k, v, 0.2, chunk=4).double(),
                               dense_prefix_causal(q, k, v, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Lq,P,Hq,Hkv,D", PREFILL_CFGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_vs_ref_cpu(Lq, P, Hq, Hkv, D, dtype):
    torch.manual_seed(Lq + P + Hq)
    q = torch.randn(Lq, Hq, D).to(dtype)
    k, v = torch.randn(Lq + P, Hkv, D).to(dtype), torch.randn(Lq + P, Hkv, D).to(dtype)
    scale = D ** -0.5
    out = prefix_causal_attention(q, k, v, scale)
    ref = prefix_causal_attention_ref(q, k, v, scale)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 partial outputs round before the merge
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(_masked_attention(q, k, v, scale).float(), ref.float(), atol=tol, rtol=tol)


# --- GPU, real sizes (H200) -----------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bs", [16, 64])
def test_gpu_decode_real_sizes(bs):
    seq_lens = [1, 100, 4097, 16000, 33333, 65537, 100003, 131072]
    B, Hq, Hkv, D = 8, 24, 4, 256
    k_cache, v_cache, bt, lens, _ = make_paged(seq_lens, Hkv, D, bs, torch.bfloat16, device="cuda")
    q = torch.randn(B, Hq, D, device="cuda").bfloat16()
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, bt, lens, D ** -0.5, out=out)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, lens, D ** -0.5)
    assert not out.isnan().any()
    # bf16: output rounding alone is ~2^-9 relative; P is rounded to bf16 for the P@V tensor-core dot
    # (again 2^-9 per weight, averaging out over the sequence). 1e-2 leaves margin; a wrong block or
    # token gives O(1) error since every key/value is independent noise.
    assert rel_err_rows(out, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_row_groups_real_sizes():
    """8 sequences x 8 verification rows (24 / 4 heads x 256) reading each sequence's rows once == each row
    alone with its sequence's block table."""
    lens_last = [100, 4097, 16000, 33333, 65537, 100003, 131072, 3200]
    k_cache, v_cache, bt, _, _ = make_paged(lens_last, 4, 256, 64, torch.bfloat16, device="cuda")
    groups, lens = grouped_rows(lens_last, [8] * 8, device="cuda")
    q = torch.randn(lens.shape[0], 24, 256, device="cuda").bfloat16()
    out = paged_attention_decode(q, k_cache, v_cache, bt, lens, 256 ** -0.5, row_groups=groups)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, bt[groups[2]], lens, 256 ** -0.5)
    assert rel_err_rows(out, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_key_base_real_sizes():
    """The 27B decode shape over the tier's scratch (8 rows x 2,560 picks, 24 / 4 heads x 256, rank 32, bf16 residual
    keys): the base inside the scores == the keys completed first by the apply_sketch_base kernel (bf16)."""
    from sketchkv.ops.sketch_base import apply_sketch_base
    B, nb, bs = 8, 40, 64
    k, v, kb, k_done = key_base_case(B, nb, bs, 4, 256, 32, torch.bfloat16, device="cuda", seed=9)
    lens = torch.randint(1500, nb * bs + 1, (B,), generator=torch.Generator().manual_seed(10)).int().cuda()
    q = torch.randn(B, 24, 256, device="cuda").bfloat16()
    out = paged_attention_decode(q, k, v, None, lens, 256 ** -0.5, key_base=kb)
    miss, hit, pool_slots, sk, sc, mean, basis = kb
    k2 = apply_sketch_base(k.view(-1, 4, 256), miss, sk, sc, mean, basis, +1, hits=hit, pool_slots=pool_slots)
    two = paged_attention_decode(q, k2.view(k.shape), v, None, lens, 256 ** -0.5)
    ref = paged_attention_decode(q.float(), k_done, v.float(), None, lens, 256 ** -0.5)
    assert rel_err_rows(out, ref) < 1e-2 and rel_err_rows(out, ref) <= rel_err_rows(two, ref)
    assert rel_err_rows(out, two) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_cuda_graph():
    # capture once, then change q / seq_lens / block tables in place and replay: nothing in the
    # launch may depend on tensor values (no host syncs, value-independent split count)
    B, Hq, Hkv, D, bs = 4, 24, 4, 256, 16
    k_cache, v_cache, bt, lens, _ = make_paged([7000] * B, Hkv, D, bs, torch.bfloat16, device="cuda")
    q = torch.randn(B, Hq, D, device="cuda").bfloat16()
    out = torch.empty_like(q)
    paged_attention_decode(q, k_cache, v_cache, bt, lens, D ** -0.5, out=out)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_attention_decode(q, k_cache, v_cache, bt, lens, D ** -0.5, out=out)
    for new_lens, perm in (([7000, 5000, 1, 300], [0, 1, 2, 3]), ([17, 4096, 0, 6999], [2, 0, 3, 1])):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        bt.copy_(bt[torch.tensor(perm)])
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, lens, D ** -0.5)
        assert not out.isnan().any()
        live = lens > 0  # the seq_len 0 row must be exactly 0
        assert rel_err_rows(out[live], ref[live]) < 1e-2 and (out[~live] == 0).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("Lq,P", [(8192, 24576), (8192, 0)])
def test_gpu_prefill_real_sizes(Lq, P, backend):
    Hq, Hkv, D = 24, 4, 256
    torch.manual_seed(0)
    q = torch.randn(Lq, Hq, D, device="cuda").bfloat16()
    k = torch.randn(Lq + P, Hkv, D, device="cuda").bfloat16()
    v = torch.randn(Lq + P, Hkv, D, device="cuda").bfloat16()
    out = prefix_causal_attention(q, k, v, D ** -0.5, backend)
    ref = prefix_causal_attention_ref(q, k, v, D ** -0.5)
    assert out.shape == ref.shape and out.is_contiguous() and not out.isnan().any()
    # bf16 flash (P rounded to bf16 for P@V) + bf16 partial outputs before the fp32 merge + bf16 output
    assert rel_err_rows(out, ref) < 1e-2


def test_prefill_backend_knob():
    q, k, v = torch.randn(40, 4, 32), torch.randn(100, 2, 32), torch.randn(100, 2, 32)
    # the CPU has one flash kernel: "cudnn" runs it too
    assert torch.equal(prefix_causal_attention(q, k, v, 0.2, "flash"), prefix_causal_attention(q, k, v, 0.2))
    with pytest.raises(ValueError, match="backend must be one of"):
        prefix_causal_attention(q, k, v, 0.2, "xformers")


@pytest.mark.gpu
@needs_cuda
def test_gpu_prefill_fp32_fallback():
    q, k, v = (torch.randn(n, h, 64, device="cuda") for n, h in ((300, 8), (1000, 2), (1000, 2)))
    torch.testing.assert_close(prefix_causal_attention(q, k, v, 0.125), prefix_causal_attention_ref(q, k, v, 0.125),
                               atol=1e-4, rtol=1e-4)
