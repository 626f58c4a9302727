"""Sparse decode: key basis, int4 sketches, deterministic selection, exactness with top_k >= context."""
import dataclasses
import os

import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.config import SparseConfig
from sketchkv.errors import CheckpointError
from sketchkv.kv.basis import KeyBasis
from sketchkv.layers.sparse_attention import SparseAttention
from sketchkv.ops import paged_attention as pa
from sketchkv.ops.sketch import (dequantize_int4, project_queries, project_queries_ref, quantize_int4,
                                 lse_sample_strides, quantize_query_int8, query_words, query_words_ref,
                                 sketch_keys_ref, sketch_score, sketch_score_dot, sketch_score_dp4a, sketch_score_ref,
                                 softmax_combine)
from sketchkv.ops.selection import SENTINEL, compose_selection, compose_selection_ref, select_top_k
from sketchkv.ops.sketch_base import apply_sketch_base, row_slots, sketch_base_ref
from sketchkv.ops.sparse_attention import sparse_attention, sparse_attention_ref
from sketchkv.ops.topk import (kth_largest_torch, kth_largest_triton, radix_hist_buffer, radix_histograms, topk,
                               topk_positions, topk_positions_torch, topk_positions_triton, topk_ref)
from conftest import run_interpreter_tests

needs_interp = pytest.mark.skipif(not pa._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


def test_int4_roundtrip_error_bound():
    x = torch.randn(1000, 4, 64)
    packed, scale = quantize_int4(x)
    assert packed.shape == (1000, 4, 32) and packed.dtype == torch.uint8
    err = (dequantize_int4(packed, scale) - x).abs()
    # symmetric 15-level grid: error at most half a step (scale / 2), plus fp16 rounding of the scale
    assert (err <= scale.float()[..., None] * 0.5 + x.abs() * 1e-3 + 1e-6).all()


def test_topk_deterministic_ties_by_position():
    s = torch.randint(0, 5, (4, 3000)).float()          # many ties
    s[1, 100:] = float("-inf")
    for k in (1, 10, 200):
        v, p = topk(s, k)
        rv, rp = topk_ref(s, k)
        assert torch.equal(p, rp) and torch.equal(v, rv)
        assert torch.equal(topk(s, k)[1], p)


def test_topk_positions_same_set_as_reference_with_ties_and_masks():
    s = torch.randint(0, 6, (3, 2, 2000)).float()
    s[0, 0, 1500:] = float("-inf")                       # fewer finite scores than k in one row
    s[1, :, :10] = float("inf")
    for k in (1, 64, 700):
        got = topk_positions(s, k, 2**31 - 1)
        _, ref = topk_ref(s, k)
        ref = torch.where(s.gather(-1, ref) > float("-inf"), ref, 2**31 - 1)
        assert torch.equal(got.long(), torch.sort(ref, -1).values)


@needs_interp
def test_interp_topk_positions_kernel_matches_torch():
    # chunks of 2048: ties of the k-th value spread over several chunks, a row with fewer finite
    # scores than k, +inf scores
    s = torch.randint(0, 6, (2, 2, 5000)).float()
    s[0, 1, 3000:] = float("-inf")
    s[1, 0, :10] = float("inf")
    for k in (1, 700, 2500):
        assert torch.equal(topk_positions(s, k, -1), topk_positions_torch(s, k, -1))
    r = torch.randn(3, 4100)
    assert torch.equal(topk_positions(r, 64, -1), topk_positions_torch(r, 64, -1))
    # more than 16 chunks (the compact kernel sums the counts of the chunks before it), coarse values tied
    # across chunks, and a row with fewer finite scores than k (padded by chunk 0)
    w = torch.round(torch.randn(2, 41000) * 3)
    w[1, 1500:] = float("-inf")
    for k in (3000, 1):
        assert torch.equal(topk_positions(w, k, 7), topk_positions_torch(w, k, 7))
        # the kernel-per-round path (the GPU's fallback when the one-kernel grid does not fit the SMs)
        assert torch.equal(topk_positions_triton(w, k, 7, kth=kth_largest_triton), topk_positions_torch(w, k, 7))


@needs_interp
def test_interp_kth_largest_radix_select_is_torch_topk_bit_for_bit():
    # negative and positive values, -inf, +-0, a wide tie, coarse values (many keys share digits), k = N
    torch.manual_seed(3)
    for rows, N, k in ((3, 5000, 1), (3, 5000, 700), (2, 4100, 4100), (5, 300, 17)):
        s = torch.randn(rows, N) * 10
        s[:, :50] = float("-inf")
        s[0, 200:220], s[0, 220:240] = -0.0, 0.0
        s[1, 100:3000] = 0.5
        s[-1] = torch.round(s[-1] * 4) / 4
        assert torch.equal(kth_largest_triton(s, k), kth_largest_torch(s, k)), (rows, N, k)


def _paged_sketch(seq_lens, Hkv, r, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum((n + bs - 1) // bs for n in seq_lens) + 2
    packed, scale = quantize_int4(torch.randn(nb, bs, Hkv, r, generator=g))
    perm = torch.randperm(nb, generator=g).int()
    width = max((n + bs - 1) // bs for n in seq_lens) + 1
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(seq_lens):
        m = (n + bs - 1) // bs
        tables[b, :m] = perm[i:i + m]
        i += m
    return packed, scale, tables, torch.tensor(seq_lens, dtype=torch.int32)


def test_sketch_score_reference_against_direct_dot():
    packed, scale, tables, lens = _paged_sketch([50, 130], Hkv=2, r=16, bs=16)
    qp = torch.randn(2, 2, 16)
    s = sketch_score_ref(qp, packed, scale, tables, lens, sinks=4, recent=8, max_len=140)
    b, t = 1, 77
    sk = dequantize_int4(packed[tables[b, t // 16], t % 16], scale[tables[b, t // 16], t % 16])
    assert torch.allclose(s[b, 0, t], (qp[b] * sk).sum(), atol=1e-5)
    assert torch.isinf(s[0, 0, :4]).all() and torch.isinf(s[0, 0, 42:]).all() and torch.isfinite(s[0, 0, 4:42]).all()


def test_sketch_score_head_combines_against_direct_computation():
    packed, scale, tables, lens = _paged_sketch([90, 300], Hkv=2, r=16, bs=16, seed=3)
    qp = torch.randn(2, 2, 3, 16)                       # B, Hkv, G query heads, r
    lo, hi = 4, 300 - 8
    sk = dequantize_int4(packed[tables[1, : (300 + 15) // 16].long()].flatten(0, 1)[:300],
                         scale[tables[1, : (300 + 15) // 16].long()].flatten(0, 1)[:300])
    per_q = torch.einsum("hgr,thr->hgt", qp[1], sk)[:, :, lo:hi]     # [Hkv, G, T] of sequence 1
    probs = torch.softmax(per_q * 0.125, -1)
    want = {("sum", True): per_q.sum((0, 1)), ("sum", False): per_q.sum(1),
            ("max", True): per_q.amax((0, 1)), ("max", False): per_q.amax(1),
            ("softmax", True): probs.sum((0, 1)).log(), ("softmax", False): probs.sum(1).log()}
    for (combine, shared), w in want.items():
        s = sketch_score_ref(qp, packed, scale, tables, lens, 4, 8, 304, shared, combine, 0.125)
        assert s.shape == (2, 1 if shared else 2, 304)
        torch.testing.assert_close(s[1, :, lo:hi], w.view(-1, hi - lo), rtol=1e-4, atol=1e-4)
        assert torch.isinf(s[1, :, :lo]).all() and torch.isinf(s[1, :, hi:]).all()
    # the sum of scores is linear in q: the group sum scored once gives the same scores
    torch.testing.assert_close(sketch_score_ref(qp.sum(2), packed, scale, tables, lens, 4, 8, 304),
                               sketch_score_ref(qp, packed, scale, tables, lens, 4, 8, 304), rtol=1e-4, atol=1e-4)


def test_softmax_combine_ranks_a_sharp_head_above_a_broad_loud_one():
    # head 0: large raw scores, broad (every odd position alike); head 1: one sharp target at t = 8.
    t = torch.arange(20)
    s = torch.stack([50.0 + 10.0 * (t % 2), torch.where(t == 8, 8.0, 0.0)])[None]
    s[0, :, :2] = float("-inf")
    assert int(s.sum(1).argmax()) % 2 == 1              # summing raw scores follows the loud head
    c = softmax_combine(s, 1, True, 1.0)
    assert int(c.argmax()) == 8 and torch.isinf(c[0, 0, :2]).all()


@needs_interp
@pytest.mark.parametrize("combine", ["sum", "max", "softmax"])
@pytest.mark.parametrize("shared", [True, False])
def test_interp_sketch_score_kernel_matches_reference(shared, combine):
    packed, scale, tables, lens = _paged_sketch([1, 37, 200, 64], Hkv=4, r=32, bs=16, seed=1)
    for qp in (torch.randn(4, 4, 32), torch.randn(4, 4, 3, 32)):   # group-summed, and per query head (G = 3)
        out = sketch_score(qp, packed, scale, tables, lens, 4, 16, 208, shared, combine, 0.2, kernel="fma")
        ref = sketch_score_ref(qp, packed, scale, tables, lens, 4, 16, 208, shared, combine, 0.2)
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        fin = torch.isfinite(ref)
        torch.testing.assert_close(out[fin], ref[fin], rtol=1e-4, atol=1e-4)


@needs_interp
def test_interp_sketch_score_dp4a_kernel_matches_reference():
    """Integer scoring (int8 query codes): the reference's scores for the dequantised codes up to fp32 rounding,
    and within the codes' rounding bound of the fp32 query's: |q - q^| <= scale / 2 per element, so a score
    moves by <= sum_r |q_r - q^_r| |k_r| (summed over the combined heads: bounds sum and max)."""
    torch.manual_seed(3)
    for r, Hkv in ((16, 4), (64, 4), (64, 3)):   # 3 KV heads: padded to 4 rows per token in the kernel
        packed, scale, tables, lens = _paged_sketch([1, 37, 200, 64], Hkv=Hkv, r=r, bs=16, seed=r)
        geo = (tables, lens, 4, 16, 208)
        for qp in (torch.randn(4, Hkv, r) * 3, torch.randn(4, Hkv, 3, r)):   # group-summed, and per query head
            codes, qs = quantize_query_int8(qp)
            assert codes.abs().max() == 127 and (qp - codes * qs[..., None]).abs().le(qs[..., None] / 2 + 1e-6).all()
            q_hat = codes.float() * qs[..., None]
            for shared, combine in ((True, "sum"), (False, "sum"), (True, "max"), (False, "max")):
                out = sketch_score_dp4a(qp, packed, scale, *geo, shared, combine, bpp=1, num_warps=2)
                ref = sketch_score_ref(q_hat, packed, scale, *geo, shared, combine)
                assert torch.equal(torch.isinf(out), torch.isinf(ref))
                fin = torch.isfinite(ref)
                torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)
                raw = sketch_score_ref(qp, packed, scale, *geo, shared, combine)
                bound = sketch_score_ref(_as_heads(qp - q_hat).abs(), _abs_sketch(packed), scale, *geo, shared, "sum")
                assert ((out - raw)[fin].abs() <= bound[fin] + 1e-4 * (1 + raw[fin].abs())).all()
    assert torch.equal(out, sketch_score(qp, packed, scale, *geo, shared, combine, kernel="dp4a"))
    with pytest.raises(ValueError, match="combine must be one of"):
        sketch_score_dp4a(qp, packed, scale, *geo, True, "mean")


@needs_interp
@pytest.mark.parametrize("shared", [True, False])
def test_interp_sketch_score_dp4a_softmax_matches_reference(shared):
    """softmax in integers: every head's score stored in fp16 (as the dot kernel does), then the same per-head
    totals and combine: the reference's log-masses for the dequantised query codes within the fp16 storage bound
    (dot_error_bound with an exact query)."""
    torch.manual_seed(4)
    sm = 0.2
    for r, Hkv in ((32, 2), (64, 3)):
        packed, scale, tables, lens = _paged_sketch([1, 37, 129], Hkv=Hkv, r=r, bs=16, seed=r)
        geo = (tables, lens, 4, 16, 141)   # 141: the last tile's stores are masked
        qp = torch.randn(3, Hkv, 3, r)
        codes, qs = quantize_query_int8(qp)
        q_hat = codes.float() * qs[..., None]
        out = sketch_score_dp4a(qp, packed, scale, *geo, shared, "softmax", sm, bpp=1, num_warps=2)
        ref = sketch_score_ref(q_hat, packed, scale, *geo, shared, "softmax", sm)
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        fin = torch.isfinite(ref)
        bound = dot_error_bound(q_hat, packed, scale, geo, shared, "softmax", sm, True)
        assert ((out - ref)[fin].abs() <= bound[fin] + 1e-4 * (1 + ref[fin].abs())).all()
        assert torch.equal(out, sketch_score(qp, packed, scale, *geo, shared, "softmax", sm, kernel="dp4a"))


@needs_interp
def test_interp_query_words_matches_reference():
    """The dp4a kernel's per-head query words: the Triton launch gives the reference's int32 words bit for bit
    (codes, sum, scale bits), and the words' signed bytes are quantize_query_int8's codes, even dims then odd."""
    torch.manual_seed(5)
    for r in (16, 64):
        qp = torch.randn(3, 4, 2, r) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None, None]
        qp[0, 0, 0] = 0.0   # an all-zero head: codes 0, the scale's floor
        words = query_words(qp)
        assert words.shape == (3, 4, 2, r // 4 + 2) and torch.equal(words, query_words_ref(qp))
        codes, qs = quantize_query_int8(qp)
        W = r // 8
        signed = (words[..., :2 * W, None] << torch.tensor([24, 16, 8, 0], dtype=torch.int32)) >> 24   # byte i of word j
        assert torch.equal(signed[..., :W, :].flatten(-2), codes[..., 0::2])
        assert torch.equal(signed[..., W:, :].flatten(-2), codes[..., 1::2])
        assert torch.equal(words[..., 2 * W], codes.sum(-1, dtype=torch.int32))
        assert torch.equal(words[..., 2 * W + 1].view(torch.float32), qs)


def _abs_sketch(packed):
    """The sketch of |k| in the same packing: scoring |q| with it gives sum_r |k_r q_r|."""
    lo = ((packed & 15).to(torch.int16) - 8).abs() + 8
    hi = ((packed >> 4).to(torch.int16) - 8).abs() + 8
    return (lo | (hi << 4)).to(torch.uint8)


def dot_error_bound(q, packed, scale, geo, shared, combine, sm, q_in_fp16: bool):
    """How far the tensor-core scores may lie from the fp32 reference. Rounding q to fp16 moves each element
    by <= 2^-11 relative, so a score by <= 2^-11 * sum_r |k_r q_r| (summed over the combined heads: bounds
    sum and max), and a softmax log-mass by <= 2 * sm_scale * the largest score move (lse moves by at most
    that, too). softmax also stores each head's score in fp16 (log2 units, |y| <= sm * log2(e) * the largest
    |score|): <= 2^-11 |y| per head, its log-sum-exp total moves by at most as much, and the log-sum-exp over the
    heads is 1-Lipschitz, so <= 2 * 2^-11 * sm * the largest |score| on the result (in nats)."""
    mag = sketch_score_ref(q.abs(), _abs_sketch(packed), scale, *geo, shared, "sum")
    if combine != "softmax":
        return torch.zeros_like(mag) if q_in_fp16 else 2.0 ** -11 * mag
    all_heads = sketch_score_ref(q.abs(), _abs_sketch(packed), scale, *geo, True, "sum")
    row_max = all_heads.nan_to_num(neginf=0.0).amax((1, 2), keepdim=True).expand_as(mag)
    stored = 2 * sm * row_max
    return 2.0 ** -11 * (stored if q_in_fp16 else stored + 2 * sm * row_max)


@needs_interp
@pytest.mark.parametrize("combine", ["sum", "max", "softmax"])
@pytest.mark.parametrize("shared", [True, False])
def test_interp_sketch_score_dot_kernel_matches_reference(shared, combine):
    """Tensor-core kernel (fp16 q): fp32-exact for sum / max when q is representable in fp16, within
    dot_error_bound otherwise (and always for softmax, which stores fp16 per-head scores)."""
    torch.manual_seed(7)
    lens, max_len, sm = [1, 37, 129], 141, 0.2   # 141: the last tile's stores are masked
    for r in (32, 64):
        packed, scale, tables, seq_lens = _paged_sketch(lens, Hkv=4, r=r, bs=16, seed=r)
        # G = 40: more heads than the combine kernel unrolls (a prompt chunk's selection: 16 rows x G queries)
        for G, (sinks, recent) in zip((1, 3, 6, 40), ((4, 16), (0, 0), (20, 3), (2, 5))):
            q = torch.randn(3, 4, G, r) * 3
            q = q[:, :, 0] if G == 1 else q                  # G = 1 also as the [B, Hkv, r] group sum
            geo = (tables, seq_lens, sinks, recent, max_len)
            for qq in (q.half().float(), q):
                out = sketch_score_dot(qq, packed, scale, *geo, shared, combine, sm)
                ref = sketch_score_ref(qq, packed, scale, *geo, shared, combine, sm)
                assert out.shape == ref.shape and torch.equal(torch.isinf(out), torch.isinf(ref))
                fin = torch.isfinite(ref)
                err = (out - ref)[fin].abs()
                bound = dot_error_bound(_as_heads(qq), packed, scale, geo, shared, combine, sm, qq is not q)
                assert (err <= bound[fin] + 1e-4 * (1 + ref[fin].abs())).all(), (r, G, err.max())
                if combine == "softmax":   # one row per launch (a scratch too small for two): the same scores
                    one = sketch_score_dot(qq, packed, scale, *geo, shared, combine, sm, scratch_bytes=1)
                    assert torch.equal(one, out)
                    two = sketch_score_dot(qq, packed, scale, *geo, shared, combine, sm, two_pass=True)
                    assert ((two - ref)[fin].abs() <= bound[fin] + 1e-4 * (1 + ref[fin].abs())).all()


@needs_interp
@pytest.mark.parametrize("kernel,combine", [("dot", "softmax"), ("dp4a", "softmax"), ("fma", "softmax"),
                                            ("dp4a", "sum")])
@pytest.mark.parametrize("shared", [True, False])
def test_interp_scoring_counts_topk_first_round(kernel, combine, shared):
    """radix_hist: the scoring kernels (softmax with stored head scores: zeroed by _lse_finish_kernel, counted by
    _softmax_combine_kernel as it writes; other paths: radix_histograms' first pass after them) leave round 0 of the
    scores and zero rounds 1-3, whatever the buffer held; top-k from there picks what it picks alone. One row per
    launch too (scratch_bytes=1: the combine runs in row groups and counts into its rows)."""
    torch.manual_seed(9)
    lens, max_len, r, Hkv = [1, 37, 129, 300], 301, 32, 2
    packed, scale, tables, seq_lens = _paged_sketch(lens, Hkv=Hkv, r=r, bs=16, seed=5)
    q = torch.randn(4, Hkv, 3, r) * 3
    geo = (tables, seq_lens, 4, 16, max_len)
    rows = 4 * (1 if shared else Hkv)
    calls = [lambda h: sketch_score(q, packed, scale, *geo, shared, combine, 0.2, kernel=kernel, radix_hist=h)]
    if kernel == "dot":
        calls.append(lambda h: sketch_score_dot(q, packed, scale, *geo, shared, combine, 0.2, scratch_bytes=1,
                                                radix_hist=h))
    for call in calls:
        hist = radix_hist_buffer(rows, q.device)
        hist.fill_(12345)                                   # stale contents must not survive
        out = call(hist)
        s = out.view(rows, max_len)
        want = radix_histograms(s, 50)
        assert torch.equal(hist[0], want[0]) and not hist[1:].any()
        for k in (1, 50, 120):
            h = hist.clone()
            assert torch.equal(topk_positions(out, k, SENTINEL, hist=h), topk_positions(out, k, SENTINEL))


@needs_interp
@pytest.mark.parametrize("shared", [True, False])
def test_interp_sampled_softmax_normalizer_one_pass_matches_reference(shared):
    """lse_stride: each head's normalizer from every st-th position of its sequence, st = min(lse_stride,
    max(1, n // lse_min_samples)) (a sampled MODE 2 pass, then _lse_finish_kernel), then one scoring pass that
    combines as it scores and counts top-k's first radix round: within the tensor-core bound of the reference's
    sampled softmax_combine, which differs from the exact one. Strides here 1 / 4 / 16 / 16 (or 1 / 4 / 4 / 4)."""
    torch.manual_seed(11)
    lens, max_len, r, Hkv, sm = [1, 37, 129, 300], 301, 32, 2, 0.2
    packed, scale, tables, seq_lens = _paged_sketch(lens, Hkv=Hkv, r=r, bs=16, seed=6)
    q = (torch.randn(4, Hkv, 3, r) * 3).half().float()
    geo = (tables, seq_lens, 4, 16, max_len)
    rows = 4 * (1 if shared else Hkv)
    for stride in (4, 16):
        hist = radix_hist_buffer(rows, q.device)
        hist.fill_(12345)                                   # stale contents must not survive
        out = sketch_score(q, packed, scale, *geo, shared, "softmax", sm, radix_hist=hist, lse_stride=stride,
                           lse_min_samples=8)
        ref = sketch_score_ref(q, packed, scale, *geo, shared, "softmax", sm, lse_stride=stride, lse_min_samples=8)
        exact = sketch_score_ref(q, packed, scale, *geo, shared, "softmax", sm)
        assert out.shape == ref.shape and torch.equal(torch.isinf(out), torch.isinf(ref))
        fin = torch.isfinite(ref)
        bound = dot_error_bound(_as_heads(q), packed, scale, geo, shared, "softmax", sm, True)
        err = (out - ref)[fin].abs()
        assert (err <= bound[fin] + 1e-4 * (1 + ref[fin].abs())).all(), (stride, err.max())
        assert (exact - ref)[fin].abs().max() > 1e-3       # the estimate is not the exact normalizer
        assert torch.equal(hist[0], radix_histograms(out.view(rows, max_len), 50)[0]) and not hist[1:].any()
        assert torch.equal(sketch_score(q, packed, scale, *geo, shared, "softmax", sm, lse_stride=stride,
                                        lse_min_samples=8), out)
        # the default minimum (4,096 positions) keeps these short sequences exact
        assert torch.equal(sketch_score_ref(q, packed, scale, *geo, shared, "softmax", sm, lse_stride=stride), exact)
    # another kernel (here: on a CPU) falls back to the reference, which samples the same positions, and counts
    hist.fill_(12345)
    fma = sketch_score(q, packed, scale, *geo, shared, "softmax", sm, kernel="fma", lse_stride=16, lse_min_samples=8,
                       radix_hist=hist)
    assert torch.equal(fma, sketch_score_ref(q, packed, scale, *geo, shared, "softmax", sm, lse_stride=16,
                                             lse_min_samples=8))
    assert torch.equal(hist[0], radix_histograms(fma.view(rows, max_len), 50)[0]) and not hist[1:].any()


def test_softmax_combine_sampled_normalizer_is_the_sampled_logsumexp():
    """The reference's estimate: per row, logsumexp over positions t % stride == 0, plus log(stride); 0 (no shift)
    for a head whose sampled positions hold no candidate. Strides: min(max, max(1, n // min_samples))."""
    assert lse_sample_strides(torch.tensor([0, 100, 8191, 8192, 40000, 10 ** 6]), 16).tolist() == [1, 1, 1, 2, 9, 16]
    s = torch.randn(3, 4, 64) * 3
    s[1, :, ::8] = float("-inf")                       # row 1: no sampled candidate
    strides = torch.tensor([8, 8, 3])
    out = softmax_combine(s, 2, False, 0.5, strides)
    x = s * 0.5
    for b, st in enumerate(strides.tolist()):
        lse = torch.logsumexp(x[b, :, ::st], -1, keepdim=True) + torch.log(torch.tensor(float(st)))
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        torch.testing.assert_close(out[b], torch.logsumexp((x[b] - lse).view(2, 2, 64), 1))


def test_softmax_combine_compiles_for_a_chunk_selection():
    """A prompt chunk's selection combines 16 rows x 6 query heads per KV head (the 27B shape). Compiled for an
    H200 on this machine (tests/triton_compile_check.py's fake device): the kernel loops over those 384 heads
    instead of unrolling them: unrolled, its IR had ~5,000 lines, took 6 minutes to compile here and made
    Triton's coalesce pass fail on the GPU (H200 run 51)."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from triton_compile_check import _FakeCudaDriver; "
            "from triton.runtime import driver; driver.set_active(_FakeCudaDriver()); "
            "from sketchkv.ops.sketch import _softmax_combine_kernel as K; t = lambda d: torch.empty(64, dtype=d); "
            "print(*(len(K.warmup(t(torch.float16), t(torch.float32), t(torch.float32), t(torch.int32), 0, 16, 16, 16, "
            "16, grid=(1,), HKV=4, G=96, TOK=1024, SHARED=s, HIST=True, num_warps=4).asm['ttir'].splitlines()) "
            "for s in (True, False)))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert all(int(n) < 500 for n in r.stdout.split()), r.stdout


def _as_heads(q):
    return q.unsqueeze(2) if q.dim() == 3 else q


@needs_interp
def test_interp_sketch_score_kernel_switch():
    packed, scale, tables, lens = _paged_sketch([37, 100], Hkv=2, r=32, bs=16, seed=2)
    qp = torch.randn(2, 2, 3, 32).half().float()
    args = (packed, scale, tables, lens, 4, 8, 112, True, "softmax", 0.2)
    assert torch.equal(sketch_score(qp, *args, kernel="dot"), sketch_score_dot(qp, *args))
    assert torch.equal(sketch_score(qp, *args), sketch_score_dot(qp, *args))   # auto: softmax on tensor cores
    fma = sketch_score(qp, *args, kernel="fma")
    torch.testing.assert_close(sketch_score(qp, *args, kernel="dot"), fma, rtol=1e-3, atol=1e-2)  # fp16 head scores
    assert torch.equal(sketch_score(qp, *args, kernel="dp4a"), sketch_score_dp4a(qp, *args))   # dp4a softmax: asked
    sum_args = (packed, scale, tables, lens, 4, 8, 112, True, "sum")
    assert torch.equal(sketch_score(qp, *sum_args), sketch_score_dp4a(qp, *sum_args))   # auto: sum in integers
    packed, scale, tables, lens = _paged_sketch([37, 100], Hkv=2, r=16, bs=16, seed=2)
    q16 = torch.randn(2, 2, 3, 16)                       # r / 2 < 16: too small for tl.dot -> "fma"
    args = (packed, scale, tables, lens, 4, 8, 112, False, "max")
    assert torch.equal(sketch_score(q16, *args, kernel="dot"), sketch_score(q16, *args, kernel="fma"))
    assert torch.equal(sketch_score(q16, *args), sketch_score_dp4a(q16, *args))   # auto: max in integers too
    args = (packed, scale, tables, lens, 4, 8, 112, True, "softmax", 0.2)       # auto picks dot: falls back too
    assert torch.equal(sketch_score(q16, *args), sketch_score(q16, *args, kernel="fma"))


def test_sketch_score_rejects_unknown_kernel():
    packed, scale, tables, lens = _paged_sketch([20], Hkv=1, r=32, bs=16)
    with pytest.raises(ValueError, match="kernel must be"):
        sketch_score(torch.randn(1, 1, 32), packed, scale, tables, lens, 0, 0, 32, kernel="wgmma")


@needs_interp
@pytest.mark.parametrize("shared", [True, False])
def test_interp_sparse_attention_kernel_matches_reference(shared):
    torch.manual_seed(0)
    B, Hq, Hkv, D, bs = 3, 8, 2, 64, 16
    lens = [40, 150, 9]
    nb = sum((n + bs - 1) // bs for n in lens) + 1
    kc, vc = torch.randn(nb, bs, Hkv, D), torch.randn(nb, bs, Hkv, D)
    tables = torch.full((B, 12), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(lens):
        m = (n + bs - 1) // bs
        tables[b, :m] = torch.arange(i, i + m)
        i += m
    H = 1 if shared else Hkv
    N = 20
    idx = torch.full((B, H, N), 2**31 - 1, dtype=torch.int32)
    counts = torch.tensor([min(n, N - 3) for n in lens], dtype=torch.int32)
    for b, n in enumerate(lens):
        for h in range(H):  # each head its own picks, the same number per sequence
            pick = torch.sort(torch.randperm(n)[: counts[b]]).values
            idx[b, h, :len(pick)] = pick.int()
    q = torch.randn(B, Hq, D)
    out = sparse_attention(q, kc, vc, tables, idx, counts, D ** -0.5)
    ref = sparse_attention_ref(q, kc, vc, tables, idx, counts, D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _random_picks(lens, leads, H, k, sinks, recent, gen):
    """Ascending, SENTINEL-padded top-k style picks among each row's candidates [sinks, lead - recent)."""
    picks = torch.full((len(lens), H, k), 2**31 - 1, dtype=torch.int32)
    for b, lead in enumerate(leads):
        cand = torch.arange(sinks, max(sinks, lead - recent))
        for h in range(H):
            m = int(torch.randint(0, min(k, len(cand)) + 1, (1,), generator=gen)) if len(cand) else 0
            if b % 2 == 0:
                m = min(k, len(cand))       # the usual case: a full top-k
            sel = cand[torch.randperm(len(cand), generator=gen)[:m]]
            picks[b, h, :m] = torch.sort(sel).values.int()
    return picks


def test_compose_selection_groups_are_ascending_and_compacted():
    gen = torch.Generator().manual_seed(3)
    lens, sinks, recent, k = [3, 20, 90, 300, 47], 8, 16, 32
    idx, counts = compose_selection_ref(_random_picks(lens, lens, 2, k, sinks, recent, gen), torch.tensor(lens),
                                        torch.tensor(lens), sinks, recent)
    for b, n in enumerate(lens):
        c = int(counts[b])
        row = idx[b, 0]
        assert (row[:c] < n).all() and (row[c:] == 2**31 - 1).all() and (row[:c].diff() > 0).all()
        assert set(range(min(n, sinks))) | set(range(max(sinks, n - recent), n)) <= set(row[:c].tolist())


@needs_interp
def test_interp_compose_selection_kernel_matches_reference():
    gen = torch.Generator().manual_seed(5)
    sinks, recent = 8, 16
    for lens, leads, H, k, extra in (([3, 20, 90, 300, 47], [3, 20, 90, 300, 47], 1, 32, 0),
                                     ([5, 700, 64, 2000], [5, 700, 64, 2000], 2, 40, 0),
                                     ([30, 31, 32, 400, 401, 402], [30, 30, 30, 400, 400, 400], 1, 1200, 2)):
        picks = _random_picks(lens, leads, H, k, sinks, recent, gen)
        args = (picks, torch.tensor(lens, dtype=torch.int32), torch.tensor(leads, dtype=torch.int32), sinks, recent,
                extra)
        idx, counts = compose_selection(*args)
        ref_idx, ref_counts = compose_selection_ref(*args)
        assert torch.equal(idx, ref_idx) and torch.equal(counts, ref_counts)



@needs_interp
def test_interp_select_top_k_is_compose_of_topk(monkeypatch):
    """select_top_k (top-k's compaction writing compose_selection's rows): the same idx and counts as the two steps,
    for scores with -inf at sinks / recent / beyond the sequence, ties across chunks, rows with fewer candidates
    than k (and none: n <= sinks + recent), one and several selection heads; with the scoring's first radix round."""
    import sketchkv.ops.selection as selection
    monkeypatch.setattr(selection, "COMPOSE_IN_TOPK", True)   # the fused path, whatever the default
    torch.manual_seed(4)
    sinks, recent = 8, 16
    for lens, H, k in (([3, 20, 90, 5000, 4100], 1, 32), ([5, 4700, 64, 2000], 2, 700), ([24, 25, 4500], 3, 1)):
        N = max(lens)
        s = torch.round(torch.randn(len(lens), H, N) * 2)
        t = torch.arange(N)
        for b, n in enumerate(lens):
            s[b, :, (t < sinks) | (t >= n - recent)] = float("-inf")
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        want = compose_selection_ref(topk_positions_torch(s, k, SENTINEL), seq_lens, seq_lens, sinks, recent)
        got = select_top_k(s, k, seq_lens, sinks, recent)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lens, H, k)
        hist = radix_histograms(s.view(-1, N), k)
        hist[1:] = 0
        got = select_top_k(s, k, seq_lens, sinks, recent, hist=hist)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lens, H, k, "hist")

def _sketch_write_case(H, D, r, T, device="cpu"):
    g = torch.Generator().manual_seed(H * D + r)
    k = torch.randn(T, H, 2 * D, generator=g)[..., :D]           # strided heads, as after the qkv split
    mean = torch.randn(H, D, generator=g) * 0.1
    basis = torch.linalg.qr(torch.randn(H, D, D, generator=g))[0][..., :r].contiguous()
    slots = torch.randperm(64, generator=g)[:T]
    return [t.to(device) for t in (k, mean, basis, slots)]


def _assert_sketch_write_matches(k, mean, basis, slots):
    from sketchkv.ops.sketch import sketch_keys_ref, sketch_write
    H, r = basis.shape[0], basis.shape[-1]
    sk = torch.zeros(8, 8, H, r // 2, dtype=torch.uint8, device=k.device)
    sc = torch.zeros(8, 8, H, dtype=torch.float16, device=k.device)
    sketch_write(k, mean, basis, sk, sc, slots)
    p, s = sketch_keys_ref(k, mean, basis)
    gp, gs = sk.view(-1, H, r // 2)[slots], sc.view(-1, H)[slots]
    # the kernel sums the projection in another order: a code may move by one at a rounding boundary
    lo = lambda x: (x & 15).int()  # noqa: E731
    hi = lambda x: (x >> 4).int()  # noqa: E731
    assert ((lo(gp) - lo(p)).abs().max() <= 1) and ((hi(gp) - hi(p)).abs().max() <= 1)
    assert (gp != p).float().mean() < 0.01
    torch.testing.assert_close(gs.float(), s.float(), rtol=2e-3, atol=0)
    untouched = torch.ones(64, dtype=torch.bool, device=k.device)
    untouched[slots] = False
    assert (sk.view(-1, H, r // 2)[untouched] == 0).all()


@needs_interp
@pytest.mark.parametrize("H,D,r", [(4, 256, 64), (2, 32, 8)])
def test_interp_sketch_write_kernel_matches_reference(H, D, r):
    _assert_sketch_write_matches(*_sketch_write_case(H, D, r, 7))


@pytest.mark.gpu
def test_gpu_sketch_write_kernel_matches_reference():
    _assert_sketch_write_matches(*_sketch_write_case(4, 256, 64, 64, "cuda"))


def _assert_project_queries_matches(B, Hkv, G, D, r, device="cpu"):
    """The query projection kernel = the einsum reference up to fp32 rounding: bf16 queries as a strided view of
    a fused projection's output (the engine's q), each group alone and summed (the "sum" combine)."""
    g = torch.Generator().manual_seed(B * G + r)
    qg = torch.randn(B, Hkv * G, 2 * D, generator=g).to(torch.bfloat16).to(device)[..., :D].unflatten(1, (Hkv, G))
    basis = torch.randn(Hkv, D, r, generator=g).to(device) / D ** 0.5
    for sum_groups in (False, True):
        got, want = project_queries(qg, basis, sum_groups), project_queries_ref(qg, basis, sum_groups)
        assert got.shape == want.shape == (B, Hkv, 1 if sum_groups else G, r)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_interp
@pytest.mark.parametrize("B,Hkv,G,D,r", [(3, 4, 6, 256, 64), (2, 2, 1, 32, 8), (1, 1, 16, 64, 16)])
def test_interp_project_queries_kernel_matches_reference(B, Hkv, G, D, r):
    _assert_project_queries_matches(B, Hkv, G, D, r)


@pytest.mark.gpu
def test_gpu_project_queries_kernel_matches_reference():
    _assert_project_queries_matches(8, 4, 6, 256, 64, "cuda")


def _assert_sketch_base_matches(Hkv, D, r, N, device="cpu"):
    """apply_sketch_base (one kernel) = x +/- the reference's mean + basis x dequantised coefficients: real int4
    sketches of random keys, rows without a slot (left as they are) and repeats, rows whose slot comes from a
    hot-buffer row (hits), a strided x (the tier's scratch view), in place and into another dtype. The GPU's dot is
    tf32 (the base only has to be the same on the write and the reads): tolerances follow; the write-then-read
    round trip is exact up to the output's rounding."""
    g = torch.Generator().manual_seed(N + r)
    slots_total = 96
    basis = torch.linalg.qr(torch.randn(Hkv, D, D, generator=g))[0][..., :r].contiguous().to(device)
    mean = torch.randn(Hkv, D, generator=g).to(device)
    keys = torch.randn(slots_total, Hkv, D, generator=g).to(device) * 3 + mean
    sk, sc = sketch_keys_ref(keys, mean, basis)
    sk, sc = sk.contiguous().view(slots_total // 16, 16, Hkv, r // 2), sc.view(slots_total // 16, 16, Hkv)
    slots = torch.randint(-1, slots_total, (N,), generator=g).to(device)
    slots[:3] = -1
    slots[3:6] = 5
    pool_slots = torch.randint(0, slots_total, (20,), generator=g).to(device)
    pool_slots[-1] = -1                          # the pool's dump row
    hits = torch.where(slots < 0, torch.randint(-1, 20, (N,), generator=g).to(device), -1)
    hits[0], hits[1] = 4, -1
    full = row_slots(slots, hits, pool_slots)
    assert full[0] == pool_slots[4] and full[1] == -1 and torch.equal(row_slots(slots, None, None), slots)
    tol = dict(rtol=1e-5, atol=1e-4) if device == "cpu" else dict(rtol=2e-3, atol=2e-2)
    for case_slots, kw in ((slots, {}), (full, dict(hits=hits, pool_slots=pool_slots))):
        want_base = sketch_base_ref(case_slots, sk, sc, mean, basis)
        ok = case_slots >= 0
        assert (want_base[~ok] == 0).all()
        # with no quantisation error the base would be the key's projection on the basis
        proj = mean + torch.einsum("nhr,hdr->nhd", torch.einsum("nhd,hdr->nhr", keys - mean, basis), basis)
        assert (want_base[ok] - proj[case_slots[ok]]).abs().amax() < 0.5 * proj.abs().amax()
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(N, Hkv, 2 * D, generator=g).to(dtype).to(device)[..., :D]
            for sign in (1, -1):
                want = x.float() + sign * want_base
                got = apply_sketch_base(x, slots, sk, sc, mean, basis, sign, **kw)
                torch.testing.assert_close(got.float(), want, rtol=max(tol["rtol"], 1e-2 if dtype != torch.float32 else 0),
                                           atol=tol["atol"] + (0.1 if dtype != torch.float32 else 0))
                assert got.dtype == dtype and torch.equal(got[~ok], x[~ok])
                out32 = apply_sketch_base(x, slots, sk, sc, mean, basis, sign, out=torch.empty(N, Hkv, D, device=device),
                                          **kw)
                torch.testing.assert_close(out32, want, **tol)
            y = x.clone()
            apply_sketch_base(y, slots, sk, sc, mean, basis, -1, out=y, **kw)     # in place
            assert torch.equal(y[~ok], x[~ok])
            back = apply_sketch_base(y.float(), slots, sk, sc, mean, basis, 1, **kw)
            torch.testing.assert_close(back, x.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                       atol=1e-4 if dtype == torch.float32 else 0.1)


@needs_interp
@pytest.mark.parametrize("Hkv,D,r,N", [(4, 256, 64, 70), (1, 64, 16, 33)])
def test_interp_sketch_base_kernel_matches_reference(Hkv, D, r, N):
    _assert_sketch_base_matches(Hkv, D, r, N)


def test_sketch_base_torch_path_matches_reference():
    _assert_sketch_base_matches(2, 32, 8, 40)   # rank 8: below the kernel's smallest dot; torch in chunks


@pytest.mark.gpu
@pytest.mark.parametrize("Hkv,D,r,N", [(4, 256, 64, 29000), (2, 64, 16, 3000)])
def test_gpu_sketch_base_kernel_matches_reference(Hkv, D, r, N):
    _assert_sketch_base_matches(Hkv, D, r, N, "cuda")


def test_interpreter_child():
    run_interpreter_tests(__file__, pa._INTERPRETED)



def _prompt(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_basis_roundtrip_and_mismatch(ckpt_with_basis, tiny_checkpoint):
    path = os.path.join(ckpt_with_basis, "key_basis.safetensors")
    llm = LLM(ckpt_with_basis, device="cpu", block_size=16)
    from sketchkv.kv.basis import model_fingerprint
    fp = model_fingerprint(llm.engine.model_config, llm.engine.model)
    b = KeyBasis.load(path, llm.engine.model_config, fp)
    assert b.rank == 8 and b.layers == [3, 7] and b.meta["tokens"] > 0
    eye = torch.einsum("lhdr,lhds->lhrs", b.bases, b.bases)
    assert torch.allclose(eye, torch.eye(8).expand_as(eye), atol=1e-4)  # orthonormal columns
    # fitted with the fp32 model (this checkpoint is fp32), it fits the same model loaded in bf16
    LLM(ckpt_with_basis, device="cpu", block_size=16, dtype="bfloat16", sparse=True)
    other_path, _ = tiny_checkpoint("qwen3_5_text", num_hidden_layers=8, seed=9, max_position_embeddings=8192)
    other = LLM(other_path, device="cpu", block_size=16)
    with pytest.raises(CheckpointError, match="fitted for another model"):
        KeyBasis.load(path, other.engine.model_config, model_fingerprint(other.engine.model_config, other.engine.model))
    with pytest.raises(CheckpointError, match="key basis file not found"):
        LLM(other_path, device="cpu", sparse=True)
    with pytest.raises(CheckpointError, match="fitted for another model"):
        LLM(other_path, device="cpu", sparse=True, sparse_basis=path)


def test_basis_truncated_is_the_lower_rank_fit(ckpt_with_basis, tmp_path):
    """PCA directions are nested: the first r columns of a rank-8 fit are the rank-r fit (same keys, same order)."""
    from sketchkv.kv.fit_basis import fit_basis
    b8 = KeyBasis.load(os.path.join(ckpt_with_basis, "key_basis.safetensors"))
    b4 = b8.truncated(4)
    assert b4.rank == 4 and b4.meta["truncated_from"] == 8 and torch.equal(b4.bases, b8.bases[..., :4])
    llm = LLM(ckpt_with_basis, device="cpu", block_size=16)
    direct = fit_basis(llm, [os.path.join(ckpt_with_basis, "calib.txt")], rank=4, max_tokens=3000, seq_len=1024,
                       progress=False)
    # eigenvectors up to sign
    cos = torch.einsum("lhdr,lhdr->lhr", direct.bases, b4.bases).abs()
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-3)
    with pytest.raises(CheckpointError, match="rank must be even"):
        b8.truncated(3)


def test_fit_basis_streams_sequences_file_by_file(tmp_path):
    """token_sequences cuts the files' tokens (in file order) into seq_len pieces, max_tokens in all, reading a
    file only when the sequences before it are consumed."""
    from sketchkv.kv.fit_basis import token_sequences
    for j in range(3):
        (tmp_path / f"f{j}.txt").write_text("x" * (10 + j))
    (tmp_path / "f9.pyc").write_bytes(b"\x00\xff")
    read = []

    def encode(text):
        read.append(len(text))
        return list(range(len(text)))

    it = token_sequences(encode, [str(tmp_path)], max_tokens=30, seq_len=8)
    assert len(next(it)) == 8 and read == [10]          # lazily: only the first file so far
    rest = list(it)
    assert [len(x) for x in rest] == [8, 8, 6] and read == [10, 11, 12]   # 30 tokens in all
    assert sum(len(x) for x in token_sequences(encode, [str(tmp_path)], 10 ** 6, 8)) == 33


@pytest.mark.parametrize("combine", ["softmax", "sum", "max"])
def test_topk_ge_context_equals_dense(ckpt_with_basis, combine):
    """top_k >= context with the sparse path forced on: every token is selected -> the dense result."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = [_prompt(300, 1), _prompt(90, 2)]
    dense = LLM(ckpt_with_basis, device="cpu", block_size=16).generate(prompt_token_ids=prompts, sampling_params=sp)
    llm = LLM(ckpt_with_basis, device="cpu", block_size=16,
              sparse=SparseConfig(sparse=True, top_k=4096, sink_tokens=4, recent_tokens=8, dense_threshold=0,
                                  head_combine=combine))
    sparse = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    for d, s in zip(dense, sparse):
        assert d.token_ids == s.token_ids
        assert max(abs(a - b) for a, b in zip(d.logprobs, s.logprobs)) < 1e-4
    layer = llm.engine.runner.sparse_layers[0]
    idx, counts = layer.last_indices
    assert counts.tolist() == [len(prompts[0]) + 23, len(prompts[1]) + 23]


def test_small_k_selects_exactly_sinks_picks_recent_and_is_deterministic(ckpt_with_basis):
    cfg = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=cfg)
        out = llm.generate(prompt_token_ids=[_prompt(400, 3)], sampling_params=sp)[0]
        idx, counts = llm.engine.runner.sparse_layers[1].last_indices
        runs.append((out.token_ids, idx.clone()))
        n = 400 + 5
        assert counts.tolist() == [4 + 16 + 8]
        sel = idx[0, 0, :28].tolist()
        assert sel[:4] == [0, 1, 2, 3] and sel[-8:] == list(range(n - 8, n))
        assert sel == sorted(set(sel))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


def test_dense_layers_decode_every_token_and_only_the_first_ones(ckpt_with_basis):
    """dense_layers = N: the first N full-attention layers decode over every token (the dense result when N covers
    them all), the others still pick sinks + top-k + recent; over the host tier a dense layer selects every row."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = [_prompt(400, 5)]
    dense = LLM(ckpt_with_basis, device="cpu", block_size=16).generate(prompt_token_ids=prompt, sampling_params=sp)[0]
    cfg = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0, dense_layers=2)
    out = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=cfg).generate(prompt_token_ids=prompt,
                                                                                sampling_params=sp)[0]
    assert out.token_ids == dense.token_ids     # this checkpoint has two full-attention layers: both dense
    assert max(abs(a - b) for a, b in zip(out.logprobs, dense.logprobs)) < 1e-4
    llm = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=dataclasses.replace(cfg, dense_layers=1))
    llm.generate(prompt_token_ids=prompt, sampling_params=sp)
    l0, l1 = llm.engine.runner.sparse_layers
    assert (l0.layer, l1.layer) == (0, 1) and l0.dense_layer and not l1.dense_layer
    assert l1.last_indices[1].tolist() == [4 + 16 + 8]
    tier = LLM(ckpt_with_basis, device="cpu", block_size=16,
               sparse=dataclasses.replace(cfg, dense_layers=1, host_tier=True, host_format="bf16",
                                                   host_budget_gb=0.05))
    tier.generate(prompt_token_ids=prompt, sampling_params=sp)
    t0, t1 = tier.engine.runner.sparse_layers
    assert t0.last_indices[1].tolist() == [400 + 7] and t1.last_indices[1].tolist() == [4 + 16 + 8]


def test_missed_mass_estimate_is_the_candidates_mass_outside_the_picks():
    from sketchkv.layers.sparse_attention import missed_mass_estimate
    p = torch.tensor([[[0.5, 0.3, 0.1, 0.1, 0.0]], [[0.25, 0.25, 0.25, 0.25, 0.0]]])
    log_mass = torch.log(p).masked_fill(p == 0, float("-inf"))        # the last position: not a candidate
    picks = torch.tensor([[[0, 1]], [[2, SENTINEL]]], dtype=torch.int32)
    est = missed_mass_estimate(log_mass, picks)
    assert torch.allclose(est, torch.tensor([0.2, 0.75]), atol=1e-6)
    none = torch.full((1, 1, 4), float("-inf"))                          # no candidates: nothing missed
    assert missed_mass_estimate(none, torch.full((1, 1, 2), SENTINEL, dtype=torch.int32)).tolist() == [0.0]


def _miss_run(eng, prompts, max_tokens):
    """Run prompts (the first prefilled alone, the others joining while it decodes: mixed steps) -> the engine's
    per-sequence, per-step missed-mass estimates, and each step's layers' own estimates [(rows of [layers])]."""
    raw = []
    for p, n in zip(prompts, max_tokens):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        eng.step()
    while eng.has_unfinished:
        eng.step()
        raw.append(torch.stack([m.last_miss_estimate.float().cpu() for m in eng.miss_layers]).T)
    return list(eng.miss_estimates), raw


def test_miss_estimate_recorded_per_sequence_and_step(ckpt_with_basis, eager_graphs):
    """sparse miss_estimate: after every step the engine holds one estimate per decoded sequence (the mean over the
    selecting layers of what each computed); dense_layers are left out; graph steps (emulated on CPU) write the same
    persistent buffers, which capture allocated once. Off: nothing recorded, no buffers."""
    cfg = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0, miss_estimate=True)
    prompts, max_tokens = [_prompt(300, 41), _prompt(200, 42)], [7, 4]
    eng = LLM(ckpt_with_basis, device="cpu", block_size=16, max_num_seqs=2, sparse=cfg).engine
    got, raw = _miss_run(eng, prompts, max_tokens)
    assert len(got) == sum(n - 1 for n in max_tokens)         # the first token of each comes from its prefill
    assert all(0 < x < 1 for x in got)
    assert torch.allclose(torch.tensor(got[-3:]), torch.cat(raw)[-3:].mean(1))   # the last steps: one sequence
    one = LLM(ckpt_with_basis, device="cpu", block_size=16, max_num_seqs=2,
              sparse=dataclasses.replace(cfg, dense_layers=1)).engine
    assert [m.layer for m in one.miss_layers] == [1]
    graphed = LLM(ckpt_with_basis, device="cpu", block_size=16, max_num_seqs=2, sparse=cfg).engine
    r = eager_graphs(graphed.runner)
    bufs = [m.miss_rows for m in graphed.miss_layers]
    assert all(b.shape == (2,) for b in bufs)                 # sized by the largest graph's warm-up, before capture
    assert _miss_run(graphed, prompts, max_tokens)[0] == pytest.approx(got, abs=1e-5)
    assert all(m.miss_rows is b for m, b in zip(graphed.miss_layers, bufs))
    assert sum(type(g).count for g in r.graphs.values()) > 0
    off = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=dataclasses.replace(cfg, miss_estimate=False)).engine
    off.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while off.has_unfinished:
        off.step()
    assert off.miss_layers == [] and not off.miss_estimates
    assert all(m.miss_rows.numel() == 0 for m in off.runner.sparse_layers)


@pytest.mark.gpu
def test_gpu_miss_estimate_under_cuda_graphs_matches_eager(tmp_path):
    """Real CUDA graphs: the per-step estimates the engine reads after graph replays (batch buckets 2 and 1) are
    the eager steps' (a tensor made fresh inside a capture would hold the capture's values on every replay)."""
    from conftest import make_checkpoint
    from sketchkv.kv.fit_basis import fit_basis
    path = str(tmp_path / "qwen3")   # no GDN layers: no fla on the GPU
    make_checkpoint(path, "qwen3", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                    num_hidden_layers=3, max_position_embeddings=4096)
    calib = os.path.join(path, "calib.txt")
    with open(calib, "w") as f:
        f.write("".join(chr(c) for c in torch.randint(32, 127, (8000,), generator=torch.Generator().manual_seed(5))))
    fit = LLM(path, device="cuda", enforce_eager=True, max_num_seqs=2, max_model_len=4096, gpu_memory_utilization=0.2)
    fit_basis(fit, [calib], rank=16, max_tokens=4000, seq_len=2048, out=os.path.join(path, "key_basis.safetensors"))
    del fit
    opts = dict(device="cuda", max_num_seqs=4, max_model_len=4096, gpu_memory_utilization=0.2, sparse=True,
                sparse_top_k=32, sparse_sink_tokens=4, sparse_recent_tokens=16, sparse_dense_threshold=0,
                sparse_miss_estimate=True)
    prompts, max_tokens = [_prompt(900, 43), _prompt(400, 44)], [10, 5]
    eager = _miss_run(LLM(path, enforce_eager=True, **opts).engine, prompts, max_tokens)[0]
    eng = LLM(path, **opts).engine
    assert eng.runner.graphs
    graphed = _miss_run(eng, prompts, max_tokens)[0]
    assert len(eager) == 13 and len(set(eager)) > 5
    assert graphed == pytest.approx(eager, abs=2e-3)


def test_decode_rows_in_mixed_steps_stay_sparse(ckpt_with_basis, monkeypatch):
    """Continuous batching: while one prompt prefills in chunks, another sequence's decode rows take
    the sparse path (not a dense prefill-style pass), and give the tokens they give alone."""
    from sketchkv.engine.context import get_context
    cfg = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [_prompt(400, 11), _prompt(600, 12)]
    alone = [LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=cfg).generate(
        prompt_token_ids=[p], sampling_params=sp)[0].token_ids for p in prompts]
    calls = []
    orig = SparseAttention.decode

    def spy(self, q, *args):
        calls.append((get_context().is_decode, args[2], q.shape[0]))
        return orig(self, q, *args)
    monkeypatch.setattr(SparseAttention, "decode", spy)
    eng = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=cfg, max_num_batched_tokens=48).engine
    first = eng.add_request(prompts[0], sp)
    while not first.output_token_ids:
        eng.step()
    second = eng.add_request(prompts[1], sp)
    while eng.has_unfinished:
        eng.step()
    assert any(not is_decode and sparse and n == 1 for is_decode, sparse, n in calls)  # mixed steps
    assert [first.output_token_ids, second.output_token_ids] == alone


@pytest.mark.parametrize("drafter", ["mtp", "oracle"])
def test_speculative_verification_sparse_per_position_is_exact(ckpt_with_basis_and_mtp, drafter):
    """Sparse decode with small top-k: verifying drafts selects per position (each draft row is a
    decode row of its own length), so greedy tokens equal non-speculative sparse decoding."""
    from test_speculative import assert_speculation_keeps_tokens
    path = ckpt_with_basis_and_mtp
    cfg = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_prompt(300, 21), _prompt(120, 22)]
    ref = [o.token_ids for o in LLM(path, device="cpu", block_size=16, sparse=cfg).generate(
        prompt_token_ids=prompts, sampling_params=sp)]
    llm = LLM(path, device="cpu", block_size=16, sparse=cfg, num_speculative_tokens=3)
    assert_speculation_keeps_tokens(llm, prompts, sp, ref, drafter)
    idx, counts = llm.engine.runner.sparse_layers[0].last_indices
    assert (counts == 4 + 16 + 8).all()  # the sparse path ran on the verified rows


@pytest.mark.parametrize("combine", ["sum", "softmax", "max"])
def test_exact_key_scores_against_direct_dot(combine):
    """The oracle selector's scores: each query head against each full key of the paged cache, the same
    candidates (not sinks, not recent, not beyond the sequence) and combines as the sketch scores."""
    from sketchkv.ops.sketch import combine_heads, exact_key_scores
    g = torch.Generator().manual_seed(5)
    B, Hkv, G, D, bs, nblk = 2, 2, 3, 16, 8, 12
    k_cache = torch.randn(nblk, bs, Hkv, D, generator=g)
    tables = torch.tensor([[3, 1, 7, 0, 5], [2, 9, 4, 11, 6]], dtype=torch.int32)
    lens = torch.tensor([37, 29], dtype=torch.int32)
    q = torch.randn(B, Hkv, G, D, generator=g)
    got = exact_key_scores(q, k_cache, tables, lens, 3, 5, 40, shared=True, combine=combine, sm_scale=0.25)
    per_q = torch.full((B, Hkv, G, 40), float("-inf"))
    for b in range(B):
        for t in range(3, int(lens[b]) - 5):
            key = k_cache[tables[b, t // bs], t % bs]                       # [Hkv, D]
            per_q[b, :, :, t] = torch.einsum("hgd,hd->hg", q[b], key)
    torch.testing.assert_close(got, combine_heads(per_q, True, combine, 0.25))
    assert torch.isinf(got[0, 0, :3]).all() and torch.isinf(got[0, 0, 32:]).all() and torch.isfinite(got[0, 0, 3:32]).all()


def test_exact_selector_runs_in_the_engine_and_is_refused_with_the_tier(ckpt_with_basis):
    """selector=exact: top_k >= context gives dense; a small k picks by the full keys (the picks differ
    from the sketch's somewhere); with the host tier (no GPU K/V) it is refused in one line."""
    from sketchkv.errors import RequestError
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    p = [_prompt(300, 4)]
    dense = LLM(ckpt_with_basis, device="cpu", block_size=16).generate(prompt_token_ids=p, sampling_params=sp)[0]
    full = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=SparseConfig(
        sparse=True, top_k=4096, sink_tokens=4, recent_tokens=8, dense_threshold=0, selector="exact"))
    assert full.generate(prompt_token_ids=p, sampling_params=sp)[0].token_ids == dense.token_ids
    picks = {}
    for selector in ("sketch", "exact"):
        llm = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=SparseConfig(
            sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0, selector=selector))
        llm.generate(prompt_token_ids=p, sampling_params=sp)
        idx, counts = llm.engine.runner.sparse_layers[0].last_indices
        assert counts.tolist() == [4 + 16 + 8]
        picks[selector] = idx.clone()
    assert not torch.equal(picks["sketch"], picks["exact"])
    with pytest.raises(RequestError, match="not with sparse_host_tier"):
        LLM(ckpt_with_basis, device="cpu", sparse=SparseConfig(sparse=True, selector="exact", host_tier=True))


def test_shared_verification_selection(ckpt_with_basis_and_mtp, eager_graphs, monkeypatch):
    """sparse_verify_selection=shared: in a verification step only each sequence's first row scores and
    picks; every row reads those picks, the sinks and the tokens from the first row's recent window up to
    its own position. With top-k covering the context that is every token: tokens equal plain decoding.
    With a small top-k it is an approximation: it runs, scores one row per sequence, and the graph steps
    (emulated on CPU) give the eager steps' tokens."""
    from test_speculative import _run_with_oracle
    import sketchkv.layers.sparse_attention as sa
    path = ckpt_with_basis_and_mtp
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_prompt(300, 21), _prompt(120, 22)]
    wide = SparseConfig(sparse=True, top_k=512, sink_tokens=4, recent_tokens=8, dense_threshold=0,
                        verify_selection="shared")
    ref = [o.token_ids for o in LLM(path, device="cpu", block_size=16, sparse=wide).generate(
        prompt_token_ids=prompts, sampling_params=sp)]
    got = _run_with_oracle(LLM(path, device="cpu", block_size=16, sparse=wide, num_speculative_tokens=3), prompts,
                           sp, {tuple(p): p + r for p, r in zip(prompts, ref)})
    assert got == ref
    scored, widths = [], []
    score, attend = sa.sketch_score, sa.sparse_attention
    monkeypatch.setattr(sa, "sketch_score", lambda qp, *a, **k: scored.append(qp.shape[0]) or score(qp, *a, **k))
    monkeypatch.setattr(sa, "sparse_attention", lambda q, kc, vc, bt, idx, *a: widths.append(idx.shape[-1])
                        or attend(q, kc, vc, bt, idx, *a))
    small = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0,
                         verify_selection="shared")
    eager = LLM(path, device="cpu", block_size=16, max_num_seqs=2, sparse=small, num_speculative_tokens=3)
    want = _run_with_oracle(eager, prompts, sp, {tuple(p): p + r for p, r in zip(prompts, ref)})
    assert 4 + 16 + 8 + 3 in widths       # verification rows: picks + sinks + recent window + the drafts
    assert scored and max(scored) <= 2   # one scoring row per sequence, never one per draft row
    graphed = LLM(path, device="cpu", block_size=16, max_num_seqs=2, sparse=small, num_speculative_tokens=3)
    r = eager_graphs(graphed.engine.runner)
    assert _run_with_oracle(graphed, prompts, sp, {tuple(p): p + r for p, r in zip(prompts, ref)}) == want
    assert sum(type(g).count for g in r.verify_graphs.values()) > 0


def test_sampled_softmax_normalizer_knob(ckpt_with_basis):
    """sparse_softmax_lse_stride: negative or with a kernel other than dot is a one-line error at load, as is a
    minimum below 1; 16 decodes (the CPU reference path) with a scoring that a sampled normalizer can change."""
    from sketchkv.errors import RequestError
    with pytest.raises(RequestError, match="sparse_softmax_lse_stride must be >= 0"):
        LLM(ckpt_with_basis, device="cpu", sparse=True, sparse_softmax_lse_stride=-1)
    with pytest.raises(RequestError, match="needs sparse_score_kernel auto or dot, got 'fma'"):
        LLM(ckpt_with_basis, device="cpu", sparse=True, sparse_softmax_lse_stride=16, sparse_score_kernel="fma")
    with pytest.raises(RequestError, match="sparse_softmax_lse_min_samples must be >= 1, got 0"):
        LLM(ckpt_with_basis, device="cpu", sparse=True, sparse_softmax_lse_stride=16, sparse_softmax_lse_min_samples=0)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cfg = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=8, dense_threshold=0, softmax_lse_stride=16,
                       softmax_lse_min_samples=16)   # 405 tokens: every 16th position
    llm = LLM(ckpt_with_basis, device="cpu", block_size=16, sparse=cfg)
    out = llm.generate(prompt_token_ids=[_prompt(400, 3)], sampling_params=sp)[0]
    assert len(out.token_ids) == 6
    idx, counts = llm.engine.runner.sparse_layers[1].last_indices
    assert counts.tolist() == [4 + 16 + 8]


@pytest.mark.parametrize("knob,value", [("sparse_head_combine", "mean"), ("sparse_score_kernel", "wgmma"),
                                        ("sparse_verify_selection", "every"), ("sparse_tier_kernel", "cuda")])
def test_bad_sparse_knob_is_one_line_error(ckpt_with_basis, knob, value):
    from sketchkv.errors import RequestError
    with pytest.raises(RequestError, match=f"{knob} must be .*got '{value}'"):
        LLM(ckpt_with_basis, device="cpu", sparse=True, **{knob: value})
    with pytest.raises(RequestError, match="prefill_attention must be one of flash, cudnn, got 'xformers'"):
        LLM(ckpt_with_basis, device="cpu", prefill_attention="xformers")
