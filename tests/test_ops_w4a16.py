"""W4A16 GEMM: packing, the dequantize reference against a naive loop, the Triton kernels against the reference
(interpreter on CPU, the 27B shapes on the GPU, under CUDA-graph capture)."""
import pytest
import torch

from sketchkv.ops import w4a16_gemm as wg
from sketchkv.ops.w4a16_gemm import (LARGE_M, Config, GemvConfig, dequantize_int4, dequantize_int4_t, pack_int4,
                                     prepare_int4_weight, unpack_int4, w4a16_matmul, w4a16_matmul_reference)
from conftest import run_interpreter_tests

needs_interp = pytest.mark.skipif(not wg._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


def random_int4(N, K, G, dtype, sym=False, device="cpu", seed=0):
    """Random q, scales ~ 1 / (4 sqrt(K)) (outputs O(1) for x ~ N(0, 1)), zeros 8 (sym) or random floats in
    [0, 15] (asym: any float zero point must work, not only integers)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, device=device, dtype=torch.uint8)
    scales = ((torch.rand(K // G, N, generator=g, device=device) + 0.5) / (4 * K ** 0.5)).to(dtype)
    zeros = (torch.full((K // G, N), 8.0, device=device) if sym
             else torch.rand(K // G, N, generator=g, device=device) * 15).to(dtype)
    return q, scales, zeros


def exact(x, q, scales, zeros, G):
    """x @ W.T with W in fp32 (no rounding of the weights): what the fused kernel computes before its output cast."""
    return x.float() @ dequantize_int4(pack_int4(q), scales.float(), zeros.float(), G).t()


# ---- packing and the reference ----------------------------------------------------------------------------

def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (24, 80), dtype=torch.uint8)
    qw = pack_int4(q)
    assert qw.dtype == torch.int32 and qw.shape == (10, 24)
    assert torch.equal(unpack_int4(qw), q)
    assert torch.equal(pack_int4(unpack_int4(qw)), qw)


def test_pack_puts_column_8i_plus_j_in_nibble_j_of_word_i():
    q = torch.randint(0, 16, (3, 16), dtype=torch.uint8)
    qw = pack_int4(q)
    for n in range(3):
        for i in range(2):
            word = sum(int(q[n, 8 * i + j]) << (4 * j) for j in range(8))
            assert qw[i, n].item() == (word - (1 << 32) if word >= 1 << 31 else word)


def test_dequantize_matches_naive_loop():
    N, K, G = 4, 16, 8
    q, s, z = random_int4(N, K, G, torch.float32)
    w = dequantize_int4(pack_int4(q), s, z, G)
    for n in range(N):
        for k in range(K):
            naive = (q[n, k].item() - z[k // G, n].item()) * s[k // G, n].item()
            assert w[n, k].item() == pytest.approx(naive, rel=1e-6)
    sb, zb = s.bfloat16(), z.bfloat16()
    wb = dequantize_int4(pack_int4(q), sb, zb, G)
    naive = (q.float() - zb.float().repeat_interleave(G, 0).t()) * sb.float().repeat_interleave(G, 0).t()
    assert wb.dtype == torch.bfloat16 and torch.equal(wb, naive.bfloat16())


def test_reference_matmul_is_x_times_dequantized_weight():
    q, s, z = random_int4(16, 64, 32, torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    qw = pack_int4(q)
    out = w4a16_matmul_reference(x, qw, s, z, 32)
    assert out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
    assert torch.equal(out, (x.float() @ dequantize_int4(qw, s, z, 32).float().t()).bfloat16())


def test_cpu_dispatch_is_the_reference_with_leading_dims():
    q, s, z = random_int4(24, 128, 64, torch.float32)
    w = prepare_int4_weight(pack_int4(q), s, z, 64)
    x = torch.randn(2, 5, 128)
    assert torch.equal(w4a16_matmul(x, w), w4a16_matmul_reference(x, pack_int4(q), s, z, 64))


@pytest.mark.parametrize("G", [32, 128, 256])
def test_prepared_weight_keeps_the_canonical_words(G):
    """prepare shuffles the words within K tiles of min(128, G) rows; qweight and the dequantization are
    the canonical ones (loaders concatenate canonical tensors before prepare)."""
    q, s, z = random_int4(16, 256, G, torch.float32)
    w = prepare_int4_weight(pack_int4(q), s, z, G)
    assert w.block_k == min(128, G) and torch.equal(w.qweight, pack_int4(q))
    assert torch.equal(wg.dequantize_prepared(w), dequantize_int4(pack_int4(q), s, z, G))
    kw, t = w.block_k // 8, 1
    for i, j in ((kw - 1, 2), (1, 6)):  # nibble j of word i in K tile t: k = t block_k + 2 ((j % 4) kw + i) + j // 4
        k = t * w.block_k + 2 * ((j % 4) * kw + i) + j // 4
        assert unpack_int4(w.packed)[3, t * w.block_k + 8 * i + j] == q[3, k]


def test_config_for_takes_tma_words_up_to_16_rows_where_tma_runs(monkeypatch):
    """H100 run 113: TMA words win at M <= 8 and lose at M = 64; never on CPU or for rows that are not 16 bytes."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not wg.config_for(8, 34816, 5120, cpu).tma
    assert not wg._tma_ok(34818, cuda)                       # N % 4: rows of words not 16-byte aligned
    monkeypatch.setattr(wg, "_tma_ok", lambda N, device: True)
    monkeypatch.setattr(wg, "_num_sms", lambda device: 132)   # an H100 without asking CUDA
    tuned = wg.TUNED[(8, 34816, 5120)]
    assert wg.config_for(8, 34816, 5120, cuda) == Config(**{**tuned.__dict__, "tma": True})
    assert wg.config_for(16, 4096, 4096, cuda).tma and wg.config_for(1, 4096, 4096, cuda).tma
    assert not wg.config_for(64, 34816, 5120, cuda).tma and not wg.config_for(17, 4096, 4096, cuda).tma


def test_prepare_rejects_mismatched_scales():
    q, s, z = random_int4(16, 64, 32, torch.float32)
    with pytest.raises(AssertionError, match="scales"):
        prepare_int4_weight(pack_int4(q), s[:1], z[:1], 32)


# ---- the kernels, interpreted ------------------------------------------------------------------------------

def _bf16_tol(dtype):
    # kernel vs fp32 weights: only its output cast, which the interpreter does by truncation (< 1 bf16 step,
    # 2^-7 relative); fp16 2^-10; fp32: accumulation order only
    return {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.float32: dict(rtol=1e-5, atol=1e-5)}[dtype]


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@needs_interp
@pytest.mark.parametrize("dtype,G,sym", [(BF16, 32, False), (BF16, 64, True), (BF16, 128, False), (BF16, 256, True),
                                         (FP16, 32, True), (FP16, 128, False), (FP32, 64, False), (FP32, 128, True)])
def test_interp_kernel_matches_reference(dtype, G, sym):
    """Rows 1, 5, 17 (partial BLOCK_M tiles), N = 40 (a partial BLOCK_N tile), split-K off and on (3 splits:
    uneven for G = 32, 8 K tiles; 5 splits of 2 tiles: the last is empty), both nibble conversions, BLOCK_M 8,
    16 and 32; G = 256 = K is per-channel."""
    N, K = 40, 256
    q, s, z = random_int4(N, K, G, dtype, sym, seed=G + sym)
    w = prepare_int4_weight(pack_int4(q), s, z, G)
    configs = [Config(block_m=16, block_n=32, split_k=5, magic=True),
               Config(block_m=8, block_n=32, split_k=3, magic=False),
               Config(block_m=32, block_n=64, split_k=2, magic=True),
               Config(block_m=16, block_n=32, split_k=1, magic=True),
               Config(block_m=16, block_n=32, split_k=3, tma=True),   # words by TMA (out-of-range columns: 0)
               Config(block_m=32, block_n=64, split_k=1, magic=False)]
    for M in (1, 5, 17):
        x = torch.randn(M, K, dtype=dtype)
        want = exact(x, q, s, z, G)
        for cfg in configs if M != 5 else configs[-3:]:
            got = w4a16_matmul(x, w, cfg)
            assert got.dtype == dtype and got.shape == (M, N)
            torch.testing.assert_close(got.float(), want, **_bf16_tol(dtype), msg=lambda m: f"M={M} {cfg}: {m}")
    assert not w.counters.any(), "split-K left a tile counter set"


@needs_interp
@pytest.mark.parametrize("G,block_k", [(32, 128), (128, 256)])
def test_interp_tiles_spanning_several_groups(G, block_k):
    """block_k > G: each shift's k range lies in one group (4 / (block_k / G) shifts per group, a dot each);
    the GEMM (both conversions, split-K) and the dequantize kernel apply each its own zero and scale."""
    N, K = 40, 512
    q, s, z = random_int4(N, K, G, torch.bfloat16, seed=block_k)
    w = prepare_int4_weight(pack_int4(q), s, z, G, block_k=block_k)
    assert w.block_k == block_k and torch.equal(w.qweight, pack_int4(q))
    x = torch.randn(3, K, dtype=torch.bfloat16)
    want = exact(x, q, s, z, G)
    for cfg in (Config(block_n=32, split_k=1), Config(block_m=8, block_n=32, split_k=2, magic=False),
                Config(block_m=16, block_n=32, split_k=2, tma=True)):
        torch.testing.assert_close(w4a16_matmul(x, w, cfg).float(), want, **_bf16_tol(torch.bfloat16))
    torch.testing.assert_close(dequantize_int4_t(w, torch.bfloat16).t().float(),
                               dequantize_int4(pack_int4(q), s, z, G).float(), rtol=2 ** -7, atol=0)


@needs_interp
def test_interp_mixed_weight_one_launch():
    """A MixedWeight (int4 columns, then bf16 rows: the GDN in_proj of a checkpoint that keeps b / a unquantized) in
    one launch: the int4 columns as the int4 GEMM alone, the tail as x @ dense^T; split-K, TMA words (decode's config on
    sm_90+), a tail of several tiles and one partial tile; fuse.linear_split gives the same pieces."""
    from sketchkv.models.fuse import linear_split
    from sketchkv.ops.w4a16_gemm import MixedWeight, mixed_in_one_launch
    N, K, ND = 40, 384, 24
    q, s, z = random_int4(N, K, 128, torch.bfloat16, seed=21)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    dense = (torch.randn(ND, K) * 0.05).to(torch.bfloat16)
    mw = MixedWeight(w, dense)
    for M in (1, 6, 20):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        assert mixed_in_one_launch(x, mw)
        want = torch.cat([exact(x, q, s, z, 128), x.float() @ dense.float().t()], -1)
        for cfg in (None, Config(block_m=16, block_n=16, split_k=3), Config(block_m=8, block_n=32, split_k=1),
                    Config(block_m=16, block_n=16, split_k=2, tma=True)):
            got = w4a16_matmul(x, mw, cfg)
            assert got.shape == (M, N + ND)
            torch.testing.assert_close(got.float(), want, **_bf16_tol(torch.bfloat16), msg=lambda m: f"{M} {cfg}: {m}")
            assert not w.counters.any(), cfg
        pieces = linear_split(x, mw, [30, 10, 12, 12])
        for got, ref in zip(pieces, w4a16_matmul(x, mw).split([30, 10, 12, 12], -1)):
            assert torch.equal(got, ref)


@needs_interp
def test_interp_split_k_repeats_identically():
    """The arrival counters reset themselves: the same call twice gives the same bits."""
    q, s, z = random_int4(32, 512, 128, torch.bfloat16, seed=3)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    cfg = Config(block_m=16, block_n=32, split_k=4)
    a, b = w4a16_matmul(x, w, cfg), w4a16_matmul(x, w, cfg)
    assert torch.equal(a, b) and not w.counters.any()


@needs_interp
def test_interp_default_config_and_leading_dims():
    q, s, z = random_int4(64, 256, 128, torch.bfloat16, seed=4)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    got = w4a16_matmul(x, w)
    torch.testing.assert_close(got.float(), exact(x.reshape(6, 256), q, s, z, 128).view(2, 3, 64),
                               **_bf16_tol(torch.bfloat16))


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("G", [32, 128])
def test_interp_dequant_kernel_matches_reference(dtype, G):
    q, s, z = random_int4(24, 256, G, dtype, seed=G)
    w = prepare_int4_weight(pack_int4(q), s, z, G)
    got, want = dequantize_int4_t(w, dtype).t(), dequantize_int4(pack_int4(q), s, z, G)
    if dtype == torch.bfloat16:  # same fp32 arithmetic; the interpreter rounds to bf16 by truncation: <= 1 step
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)


@needs_interp
def test_interp_large_m_dequantizes_then_matmuls():
    q, s, z = random_int4(16, 64, 32, torch.float32, seed=7)
    w = prepare_int4_weight(pack_int4(q), s, z, 32)
    x = torch.randn(wg.LARGE_M, 64)
    torch.testing.assert_close(w4a16_matmul(x, w), w4a16_matmul_reference(x, pack_int4(q), s, z, 32),
                               rtol=1e-5, atol=1e-5)


def _gemv_tol(dtype):
    # the output cast as _bf16_tol, plus the kernel's fp32 offset: byte b's lo nibble sits 2^-15 below the
    # float's leading 2^15, so each FFMA rounds ~2^15 x 2^-24 |x| (~2e-4 of the output's rms over K terms)
    return {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=4e-3),
            torch.float32: dict(rtol=1e-3, atol=3e-3)}[dtype]


@needs_interp
@pytest.mark.parametrize("dtype,G,sym", [(BF16, 32, False), (BF16, 64, True), (BF16, 128, False), (FP16, 32, True),
                                         (FP16, 128, False), (FP32, 64, False), (FP32, 128, True)])
def test_interp_gemv_matches_reference(dtype, G, sym):
    """The small-M CUDA-core kernel: rows 1, 3 (a padded BLOCK_M), 8, 16; N = 40 (partial column tiles); K
    tiles min(128, G) split 3 ways (uneven for G = 32: 16 tiles) and 6 ways over K = 512 / G (G = 128: 4
    tiles, 1 per split, 2 splits empty; G = 64: 8 tiles, 2 per split, the last empty) and unsplit; row
    chunks of 2 and 4 (G = 32: the whole 4-row tile); 16-bit x read as pairs, fp32 x per element."""
    N, K = 40, 512
    q, s, z = random_int4(N, K, G, dtype, sym, seed=G + sym)
    w = prepare_int4_weight(pack_int4(q), s, z, G)
    assert wg.gemv_supported(w)
    configs = [GemvConfig(block_n=32, rows=2, split_k=3, num_warps=1),
               GemvConfig(block_n=64, rows=4, split_k=6, num_warps=1),
               GemvConfig(block_n=32, rows=2, split_k=1, num_warps=1)]
    for M in (1, 3, 8, 16):
        x = torch.randn(M, K, dtype=dtype)
        want = exact(x, q, s, z, G)
        for cfg in configs if M in (1, 3) else configs[:1]:
            got = w4a16_matmul(x, w, cfg)
            assert got.dtype == dtype and got.shape == (M, N)
            torch.testing.assert_close(got.float(), want, **_gemv_tol(dtype), msg=lambda m: f"M={M} {cfg}: {m}")
    assert not w.counters.any(), "split-K left a tile counter set"


@needs_interp
def test_interp_gemv_dispatch_switch_and_fallback(monkeypatch):
    """GEMV_MAX_M routes small M to the CUDA-core kernel (same bits as asking for it, leading dims kept);
    weights whose K tiles span several groups (block_k > G) stay on the tensor-core kernel; the load probe
    xors the same words the kernel reads."""
    q, s, z = random_int4(64, 256, 128, torch.bfloat16, seed=9)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    x = torch.randn(2, 1, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(wg, "GEMV_MAX_M", 2)
    monkeypatch.setattr(wg, "GEMV_TUNED", {(2, 64, 256): GemvConfig(block_n=32, rows=4, split_k=2, num_warps=1)})
    got = w4a16_matmul(x, w)
    assert torch.equal(got.view(2, 64), wg.w4a16_gemv_triton(x.view(2, 256), w, wg.GEMV_TUNED[(2, 64, 256)]))
    torch.testing.assert_close(got.float(), exact(x.view(2, 256), q, s, z, 128).view(2, 1, 64), **_gemv_tol(BF16))
    q2, s2, z2 = random_int4(64, 512, 32, torch.bfloat16, seed=10)
    w2 = prepare_int4_weight(pack_int4(q2), s2, z2, 32, block_k=128)
    assert not wg.gemv_supported(w2)
    x2 = torch.randn(1, 512, dtype=torch.bfloat16)
    torch.testing.assert_close(w4a16_matmul(x2, w2).float(), exact(x2, q2, s2, z2, 32), **_bf16_tol(BF16))
    cfg = GemvConfig(block_n=32, rows=2, split_k=3, num_warps=1)
    probe = wg.gemv_load_probe(w, cfg)
    want = []  # program (n tile, split) at split * n tiles + n tile: 2 splits of one 16-row K tile each
    for sk in range(2):
        for nt in range(2):
            v = 0
            for word in w.packed[16 * sk:16 * (sk + 1), 32 * nt:32 * (nt + 1)].flatten().tolist():
                v ^= word
            want.append(v)
    assert probe.tolist() == want


def test_interpreter_child():
    run_interpreter_tests(__file__, wg._INTERPRETED)


# ---- the GPU, 27B shapes -----------------------------------------------------------------------------------

SHAPES_27B = {"gate_up": (5120, 34816), "down": (17408, 5120), "gdn_in": (5120, 16384),
              "attn_qkv": (5120, 14336), "o/out": (6144, 5120)}


def _check_gpu(got, x, q, s, z, G, what: str = ""):
    """got against x @ W^T in fp32. The fused kernel (M < LARGE_M) multiplies the exact weights in fp32 and rounds
    its output once (2^-9 relative). The prefill path (M >= LARGE_M) dequantizes the weights to x's dtype first and
    hands them to cuBLAS, so its reference is those rounded weights: against the exact ones the rounding alone is
    ~2.3e-3 of the output's rms per output (one sigma; zero points far from the codes make the weights larger than
    the output suggests), and over a 27B shape's outputs its tail reached the bound twice in ~55 runs of a shape's
    test (H200 runs 131 and 132; run 132's: attn_qkv, M = 2,048, 1 of 29M outputs, excess 1e-3). Either way a wrong
    nibble, group or split is off by O(rms)."""
    w = dequantize_int4(pack_int4(q), s.float(), z.float(), G)
    if x.shape[0] >= LARGE_M and got.is_cuda:
        w = w.to(x.dtype).float()
    want = x.float() @ w.t()
    err = (got.float() - want).abs()
    bound = want.abs() * 2 ** -7 + 1e-2 * want.pow(2).mean().sqrt()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs off, max excess "
                           f"{(err - bound).max().item():.3g}, first at {tuple(bad.nonzero()[0].tolist())}")


@pytest.mark.gpu
def test_gpu_mixed_weight_one_launch_27b_gdn_in_proj():
    """The 27B GDN in_proj as a W4A16 checkpoint loads it: int4 q/k/v/z (16,384 columns) and the bf16 gates b / a (96
    rows) in one launch, at decode sizes and with other configs; the tail against x @ dense^T (fp32 products, one
    bf16 rounding), the int4 columns against the exact reference; a CUDA graph replays it."""
    from sketchkv.ops.w4a16_gemm import MixedWeight
    q, s, z = random_int4(16384, 5120, 128, torch.bfloat16, device="cuda", seed=5)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    dense = (torch.randn(96, 5120, device="cuda") * 0.02).to(torch.bfloat16)
    mw = MixedWeight(w, dense)
    for M in (1, 8, 64):
        x = torch.randn(M, 5120, device="cuda", dtype=torch.bfloat16)
        tail = x.float() @ dense.float().t()
        for cfg in (None, Config(block_m=16, block_n=128, split_k=4, tma=True),
                    Config(block_m=64, block_n=128, split_k=1, num_warps=8)):
            got = w4a16_matmul(x, mw, cfg)
            _check_gpu(got[:, :16384], x, q, s, z, 128)
            torch.testing.assert_close(got[:, 16384:].float(), tail, rtol=2 ** -7, atol=1e-3 * tail.abs().max().item())
    assert not w.counters.any()
    x = torch.randn(8, 5120, device="cuda", dtype=torch.bfloat16)
    want = w4a16_matmul(x, mw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w4a16_matmul(x, mw)
    g.replay()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES_27B))
def test_gpu_27b_shapes_match_reference(name):
    K, N = SHAPES_27B[name]
    q, s, z = random_int4(N, K, 128, torch.bfloat16, device="cuda", seed=1)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    for M in (1, 8, 64, 512, 2048):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        how = "dequantize + cuBLAS" if M >= LARGE_M else wg.config_for(M, N, K, x.device)
        _check_gpu(w4a16_matmul(x, w), x, q, s, z, 128, f"{name} M = {M}, {how}")
    assert not w.counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("G", [32, 64, 128, 5120])
@pytest.mark.parametrize("sym", [False, True])
def test_gpu_group_sizes_and_configs(G, sym):
    q, s, z = random_int4(4096, 5120, G, torch.bfloat16, sym, device="cuda", seed=G)
    w = prepare_int4_weight(pack_int4(q), s, z, G)
    for M in (1, 13, 64, 100):
        x = torch.randn(M, 5120, device="cuda", dtype=torch.bfloat16)
        for cfg in (None, Config(block_m=8, block_n=256, split_k=8, magic=False),  # split 16: 40 tiles, 2 splits empty
                    Config(block_m=64, block_n=64, split_k=4), Config(block_m=16, block_n=128, split_k=16),
                    Config(block_m=16, block_n=128, split_k=4, num_stages=4, tma=True),
                    Config(block_m=64, block_n=128, split_k=1, num_warps=8),
                    Config(block_m=64, block_n=256, split_k=2, num_warps=8),
                    Config(block_m=16, block_n=64, split_k=8)):
            _check_gpu(w4a16_matmul(x, w, cfg), x, q, s, z, G)


@pytest.mark.gpu
@pytest.mark.parametrize("G,block_k", [(128, 256), (32, 128)])
def test_gpu_tiles_spanning_several_groups(G, block_k):
    """K tiles of 2 and 4 groups (a dot per group) through the GEMM and the prefill dequantize."""
    q, s, z = random_int4(4096, 5120, G, torch.bfloat16, device="cuda", seed=block_k)
    w = prepare_int4_weight(pack_int4(q), s, z, G, block_k=block_k)
    for M in (1, 64, 512):
        x = torch.randn(M, 5120, device="cuda", dtype=torch.bfloat16)
        for cfg in ((None, Config(block_m=16, block_n=128, split_k=4, magic=False), Config(block_m=64, split_k=2),
                     Config(block_m=16, block_n=128, split_k=4, tma=True))
                    if M < 512 else (None,)):
            _check_gpu(w4a16_matmul(x, w, cfg), x, q, s, z, G)
    assert not w.counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES_27B))
def test_gpu_gemv_27b_shapes_match_reference(name):
    """The small-M CUDA-core kernel at the 27B shapes, its default config and a few others (split-K with empty
    splits: 40 K tiles in 16; unsplit; 8 and 16 columns per thread), asym G = 128 and sym G = 32."""
    K, N = SHAPES_27B[name]
    for G, sym in ((128, False), (32, True)):
        q, s, z = random_int4(N, K, G, torch.bfloat16, sym, device="cuda", seed=3)
        w = prepare_int4_weight(pack_int4(q), s, z, G)
        for M in (1, 2, 4, 8, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cfgs = [wg.gemv_config_for(M, N, K, x.device)]
            if M <= 2:
                cfgs += [GemvConfig(block_n=512, rows=4, split_k=16, num_warps=2),
                         GemvConfig(block_n=1024, rows=2, split_k=1, num_warps=2)]
            for cfg in cfgs:
                _check_gpu(w4a16_matmul(x, w, cfg), x, q, s, z, G)
        assert not w.counters.any()


@pytest.mark.gpu
def test_gpu_gemv_cuda_graph_replay_is_deterministic():
    """Under a CUDA graph the split-K kernel gives the eager call's bits (splits summed in order)."""
    K, N = SHAPES_27B["down"]
    q, s, z = random_int4(N, K, 128, torch.bfloat16, device="cuda", seed=4)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    for M in (1, 2, 8):
        cfg = wg.gemv_config_for(M, N, K, torch.device("cuda"))
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            w4a16_matmul(x, w, cfg)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = w4a16_matmul(x, w, cfg)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            _check_gpu(out, x, q, s, z, 128)
            assert torch.equal(out, w4a16_matmul(x, w, cfg)), M
        assert not w.counters.any(), M


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_eager():
    K, N = SHAPES_27B["down"]
    q, s, z = random_int4(N, K, 128, torch.bfloat16, device="cuda", seed=2)
    w = prepare_int4_weight(pack_int4(q), s, z, 128)
    for M in (1, 8, 64, 512):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        eager = w4a16_matmul(x, w)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            w4a16_matmul(x, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = w4a16_matmul(x, w)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            _check_gpu(out, x, q, s, z, 128)
        x.copy_(torch.randn_like(x))
        graph.replay()
        again = w4a16_matmul(x, w)
        assert eager.shape == out.shape, M
        if M < LARGE_M:  # our kernel: the same bits in a graph (split-K sums in split order)
            assert torch.equal(out, again), (M, (out.float() - again.float()).abs().max().item())
        else:  # cuBLAS may pick another algorithm under capture: equal up to bf16 rounding
            torch.testing.assert_close(out, again, rtol=2 ** -7, atol=1e-2 * again.float().pow(2).mean().sqrt().item())
        assert not w.counters.any(), M
