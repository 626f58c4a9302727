"""Sparse-decode kernels against their PyTorch references at the issue's real sizes, on the GPU (H200):
4 KV heads x 256 dims, 24 query heads, rank 64, 250K-token contexts, batch 8, fresh random inputs."""
import pytest
import torch

from sketchkv.ops.sketch import (quantize_int4, quantize_query_int8, query_words, query_words_ref, sketch_score,
                                 sketch_score_dot, sketch_score_dp4a, sketch_score_ref)
from sketchkv.ops.sparse_attention import sparse_attention, sparse_attention_ref
from sketchkv.ops.topk import (kth_largest_torch, kth_largest_triton, radix_hist_buffer, radix_histograms,
                               topk_positions, topk_positions_torch, topk_positions_triton, topk_ref)
from test_sparse import _abs_sketch, dot_error_bound

pytestmark = pytest.mark.gpu

B, HQ, HKV, D, R, BS = 8, 24, 4, 256, 64, 64
SENTINEL = 2**31 - 1


def _tables(seq_lens, gen):
    """Block tables over a shuffled pool (no two sequences share a block), as the block manager leaves them."""
    need = [(n + BS - 1) // BS for n in seq_lens]
    perm = torch.randperm(sum(need) + 1, generator=gen).int()
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    i = 0
    for b, m in enumerate(need):
        tables[b, :m] = perm[i:i + m]
        i += m
    return tables.cuda(), sum(need) + 1


def _sketch_250k(seed: int):
    """Fresh random sketches of B ~250K-token sequences over a shuffled block pool and every query head,
    projected: (q [B, Hkv, G, r], packed, scale, (tables, seq_lens, sinks 64, recent 1024, max_len))."""
    gen = torch.Generator().manual_seed(seed)
    lens = [250_000 - 977 * b for b in range(B)]
    tables, nb = _tables(lens, gen)
    packed, scale = quantize_int4(torch.randn(nb, BS, HKV, R, device="cuda"))
    q = torch.randn(B, HKV, HQ // HKV, R, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, packed, scale, (tables, seq_lens, 64, 1024, tables.shape[1] * BS)


@pytest.mark.parametrize("shared,combine", [(True, "sum"), (False, "sum"), (True, "softmax"), (True, "max")])
def test_gpu_sketch_score_250k(shared, combine):
    """The default kernels against the fp32 reference: softmax (dot, fp16 q) to 1e-3; sum and max (dp4a, int8 query
    codes) within the codes' rounding bound, sum_r |q_r - q^_r| |k_r| over the combined heads."""
    qp, packed, scale, geo = _sketch_250k(11)
    args = (qp, packed, scale, *geo, shared, combine, D ** -0.5)
    out, ref = sketch_score(*args), sketch_score_ref(*args)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    if combine == "softmax":
        torch.testing.assert_close(out[fin], ref[fin], rtol=1e-3, atol=1e-3)
        return
    codes, qs = quantize_query_int8(qp)
    bound = sketch_score_ref((qp - codes * qs[..., None]).abs(), _abs_sketch(packed), scale, *geo, shared, "sum")
    assert ((out - ref)[fin].abs() <= bound[fin] + 1e-4 * (1 + ref[fin].abs())).all()


@pytest.mark.parametrize("shared,combine", [(True, "sum"), (False, "sum"), (True, "softmax"), (False, "softmax"),
                                            (True, "max")])
def test_gpu_sketch_score_dot_250k(shared, combine):
    """Tensor-core kernel: fp32-exact up to accumulation order for fp16-representable q; with fresh q
    within the fp16 rounding bound of q (see test_interp_sketch_score_dot_kernel_matches_reference)."""
    q, packed, scale, geo = _sketch_250k(11)
    qs = [q.half().float(), q] + ([q.sum(2)] if combine == "sum" else [])   # + the engine's group-summed form
    for i, qq in enumerate(qs):
        out = sketch_score_dot(qq, packed, scale, *geo, shared, combine, D ** -0.5)
        ref = sketch_score_ref(qq, packed, scale, *geo, shared, combine, D ** -0.5)
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        fin = torch.isfinite(ref)
        bound = dot_error_bound(qq if qq.dim() == 4 else qq.unsqueeze(2), packed, scale, geo, shared, combine,
                                D ** -0.5, i == 0)
        err = (out - ref)[fin].abs()
        assert (err <= bound[fin] + 1e-3 * (1 + ref[fin].abs())).all(), err.max()
    assert torch.equal(sketch_score(q, packed, scale, *geo, shared, combine, D ** -0.5, kernel="dot"),
                       sketch_score_dot(q, packed, scale, *geo, shared, combine, D ** -0.5))
    # the PTX int4 unpacking (the default on CUDA) and the Triton-op one give the same fp16 operands: same scores
    assert torch.equal(sketch_score_dot(q, packed, scale, *geo, shared, combine, D ** -0.5, unpack="asm"),
                       sketch_score_dot(q, packed, scale, *geo, shared, combine, D ** -0.5, unpack="ops"))


@pytest.mark.parametrize("shared,combine", [(True, "sum"), (False, "sum"), (True, "max"), (True, "softmax")])
def test_gpu_sketch_score_dp4a_250k(shared, combine):
    """Integer kernel: the PTX dp4a path and the Triton-op path give the same integers (bitwise the same
    scores; with the KV heads summed, up to the order of that fp32 sum: the two paths' layouts differ); both the
    reference's for the dequantised query codes up to fp32 rounding (softmax: within its fp16 storage bound)."""
    q, packed, scale, geo = _sketch_250k(12)
    sm = D ** -0.5
    for qq in ([q.sum(2), q] if combine == "sum" else [q]):     # the engine's group-summed form, and every head
        out = sketch_score_dp4a(qq, packed, scale, *geo, shared, combine, sm)
        ops = sketch_score_dp4a(qq, packed, scale, *geo, shared, combine, sm, unpack="ops")
        if shared and combine == "sum":
            assert torch.equal(torch.isinf(out), torch.isinf(ops))
            torch.testing.assert_close(out, ops, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(out, ops)
        assert torch.equal(query_words(qq), query_words_ref(qq))   # the words kernel: the reference's bits
        codes, qs = quantize_query_int8(qq)
        q_hat = codes.float() * qs[..., None]
        ref = sketch_score_ref(q_hat, packed, scale, *geo, shared, combine, sm)
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        fin = torch.isfinite(ref)
        if combine == "softmax":
            bound = dot_error_bound(q_hat, packed, scale, geo, shared, combine, sm, True)
            assert ((out - ref)[fin].abs() <= bound[fin] + 1e-3 * (1 + ref[fin].abs())).all()
        else:
            torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-4)
    assert torch.equal(sketch_score(q, packed, scale, *geo, shared, combine, sm, kernel="dp4a"),
                       sketch_score_dp4a(q, packed, scale, *geo, shared, combine, sm))


def test_gpu_topk_positions_250k_same_set_as_reference():
    torch.manual_seed(12)
    s = torch.randn(B, 1, 250_000, device="cuda")
    s[:, :, :64] = float("-inf")                       # sinks and recent rows are masked out of the scores
    s[:, :, -1024:] = float("-inf")
    s[0, 0, 5000:] = float("-inf")                     # a short sequence: fewer finite scores than k
    s[1, 0, 100:5000] = s[1, 0, 100:5000].round()      # many ties: broken by position
    k = 2048
    got = topk_positions(s, k, SENTINEL)
    _, ref = topk_ref(s, k)
    ref = torch.where(s.gather(-1, ref) > float("-inf"), ref, SENTINEL)
    assert torch.equal(got.long(), torch.sort(ref, -1).values)
    assert torch.equal(topk_positions(s, k, SENTINEL), got)  # deterministic


def test_gpu_topk_radix_paths_equal_torch():
    # the engine's 7 launches (count and compaction read the k-th value out of the radix histograms), the same with
    # the k-th value from kth_largest_triton / torch.topk, against the PyTorch version: 4 and 8 rows (a read group,
    # all 8 agents), a tie-heavy row, a short row, and 32 rows (per-KV-head selection)
    torch.manual_seed(21)
    for rows in (4, 8, 32):
        s = torch.randn(rows, 250_000, device="cuda")
        s[:, :64] = float("-inf")
        s[0, 7000:] = float("-inf")
        s[1] = torch.round(s[1] * 2)
        ref = topk_positions_torch(s, 2048, SENTINEL)
        assert torch.equal(topk_positions(s, 2048, SENTINEL), ref), rows
        assert torch.equal(topk_positions_triton(s, 2048, SENTINEL, kth=kth_largest_triton), ref), rows
        assert torch.equal(kth_largest_triton(s, 2048), kth_largest_torch(s, 2048)), rows


@pytest.mark.parametrize("kernel,combine,shared", [("dot", "softmax", True), ("dot", "softmax", False),
                                                   ("dp4a", "sum", True)])
def test_gpu_topk_first_round_counted_by_scoring(kernel, combine, shared):
    """The engine's pick at 8 x 250K: the scoring kernels count top-k's first radix round as they write the scores
    (radix_hist, any stale contents): round 0 equal to radix_histograms', rounds 1-3 zero, and the same picks as
    top-k alone, in 4-row read groups and all 8 rows."""
    q, packed, scale, geo = _sketch_250k(14)
    for rows in (slice(0, 4), slice(0, 8)):
        g = (geo[0][rows], geo[1][rows], *geo[2:])
        n = (rows.stop - rows.start) * (1 if shared else HKV)
        hist = radix_hist_buffer(n, q.device)
        hist.fill_(-7)
        out = sketch_score(q[rows], packed, scale, *g, shared, combine, D ** -0.5, kernel=kernel, radix_hist=hist)
        want = radix_histograms(out.view(n, -1), 2048)
        assert torch.equal(hist[0], want[0]) and not hist[1:].any()
        assert torch.equal(topk_positions(out, 2048, SENTINEL, hist=hist), topk_positions(out, 2048, SENTINEL))


@pytest.mark.parametrize("shared", [True, False])
def test_gpu_sampled_softmax_normalizer_one_pass_250k(shared):
    """lse_stride 16 at 8 x 250K: the one-pass softmax (normalizers from every 16th position first: at the default
    minimum of 4,096 positions every sequence here samples with stride 16) within the tensor-core bound of the
    sampled reference, its counted first radix round equal to radix_histograms', and the same picks as top-k alone;
    in 4-row read groups and all 8 rows."""
    q, packed, scale, geo = _sketch_250k(15)
    sm = D ** -0.5
    for rows in (slice(0, 4), slice(0, 8)):
        g = (geo[0][rows], geo[1][rows], *geo[2:])
        qq = q[rows].half().float()
        n = (rows.stop - rows.start) * (1 if shared else HKV)
        hist = radix_hist_buffer(n, q.device)
        hist.fill_(-7)
        out = sketch_score(qq, packed, scale, *g, shared, "softmax", sm, radix_hist=hist, lse_stride=16)
        ref = sketch_score_ref(qq, packed, scale, *g, shared, "softmax", sm, lse_stride=16)
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        fin = torch.isfinite(ref)
        bound = dot_error_bound(qq, packed, scale, g, shared, "softmax", sm, True)
        err = (out - ref)[fin].abs()
        assert (err <= bound[fin] + 1e-3 * (1 + ref[fin].abs())).all(), err.max()
        want = radix_histograms(out.view(n, -1), 2048)
        assert torch.equal(hist[0], want[0]) and not hist[1:].any()
        assert torch.equal(topk_positions(out, 2048, SENTINEL, hist=hist), topk_positions(out, 2048, SENTINEL))


@pytest.mark.parametrize("shared", [True, False])
def test_gpu_select_top_k_is_compose_of_topk(shared, monkeypatch):
    """The engine's plain decode selection at 8 x 250K: top-k's compaction writing the composed rows (sinks, picks,
    recent) equals compose_selection of the picks, from the softmax scores and their counted first round."""
    import sketchkv.ops.selection as selection
    from sketchkv.ops.selection import compose_selection, select_top_k
    monkeypatch.setattr(selection, "COMPOSE_IN_TOPK", True)   # the fused path, whatever the default
    q, packed, scale, geo = _sketch_250k(15)
    n = geo[1].shape[0] * (1 if shared else HKV)
    hist = radix_hist_buffer(n, q.device)
    out = sketch_score(q, packed, scale, *geo, shared, "softmax", D ** -0.5, kernel="dot", radix_hist=hist)
    want = compose_selection(topk_positions(out, 2048, SENTINEL), geo[1], geo[1], geo[2], geo[3])
    got = select_top_k(out, 2048, geo[1], geo[2], geo[3], hist=hist)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sparse_attention_250k(dtype):
    gen = torch.Generator().manual_seed(13)
    lens = [250_000 - 4099 * b for b in range(B)]
    tables, nb = _tables(lens, gen)
    kc = torch.randn(nb, BS, HKV, D, device="cuda", dtype=dtype)
    vc = torch.randn(nb, BS, HKV, D, device="cuda", dtype=dtype)
    n_pick = 64 + 2048 + 1024
    idx = torch.full((B, 1, n_pick), SENTINEL, dtype=torch.int32)
    counts = torch.empty(B, dtype=torch.int32)
    for b, n in enumerate(lens):
        pick = torch.cat([torch.arange(64), 64 + torch.randperm(n - 64 - 1024, generator=gen)[:2048],
                          torch.arange(n - 1024, n)])
        pick = torch.sort(pick).values
        idx[b, 0, :len(pick)] = pick.int()
        counts[b] = len(pick)
    idx, counts = idx.cuda(), counts.cuda()
    q = torch.randn(B, HQ, D, device="cuda", dtype=dtype)
    out = sparse_attention(q, kc, vc, tables, idx, counts, D ** -0.5)
    ref = sparse_attention_ref(q.float(), kc.float(), vc.float(), tables, idx, counts, D ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
