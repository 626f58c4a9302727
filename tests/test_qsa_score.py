"""QSA decode selection on the GPU path: the fused block-score kernel (ops/qsa_score.py) against its PyTorch
reference, and the deterministic block select (ops/qsa.py `select_blocks`) against `select_positions`."""
import pytest
import torch

from sketchkv.ops import qsa_score
from sketchkv.ops.qsa import SENTINEL, select_blocks, select_positions
from sketchkv.ops.qsa_score import qsa_block_scores, qsa_block_scores_ref
from conftest import run_interpreter_tests

needs_interp = pytest.mark.skipif(not qsa_score._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _paged_index(lens, H, D, c, bs, dtype, gen, device="cpu"):
    """Index queries, index keys paged as the runner lays them out (bs // c rows per KV block over a shuffled
    pool + a dump row), block tables padded with -1 (one spare column past the longest sequence)."""
    per = bs // c
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 1
    perm = torch.randperm(nb, generator=gen).int()
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    i = 0
    for b, m in enumerate(need):
        tables[b, :m] = perm[i:i + m]
        i += m
    keys = torch.randn(nb * per + 1, D, generator=gen).to(dtype)
    q = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    visible = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), keys.to(device), tables.to(device), visible.to(device)


def _masked_random_scores(visible, G, c, gen):
    """Continuous random scores (no ties), -inf at blocks a query cannot see, as qsa_block_scores writes them."""
    s = torch.randn(len(visible), G, generator=gen)
    return s.masked_fill(torch.arange(G)[None, :] >= (visible.long() // c)[:, None], float("-inf"))


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D", [(2, 32), (16, 128), (2, 128), (16, 32)])
@pytest.mark.parametrize("bs", [16, 64])
def test_interp_qsa_block_scores(dtype, H, D, bs):
    # ragged rows: nothing visible, less than one block (visible < c), block boundaries, several key tiles
    # (BG = 128 blocks) with a ragged last one; G over the whole table width (graph) and over the longest row
    gen = torch.Generator().manual_seed(H * D + bs)
    c = 4
    lens = [1, 3, 4, 37, 200, 513, 1030, 0]
    q, keys, tables, visible = _paged_index(lens, H, D, c, bs, dtype, gen)
    for G in (tables.shape[1] * bs // c, max(lens) // c):
        out = qsa_block_scores(q, keys, tables, visible, G, c, bs)
        ref = qsa_block_scores_ref(q, keys, tables, visible, G, c, bs)
        assert out.shape == (len(lens), G) and out.dtype == torch.float32
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        # fp32 sums of D products (bf16 products are exact in fp32) in another order: ~1e-6 relative
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        if H == 16:  # relu-sums over 16 heads: no exact ties (zero scores need all 16 dots negative)
            for k in (1, 8, 100):
                assert all(torch.equal(a, b) for a, b in zip(select_blocks(out, visible, k, c),
                                                             select_positions(ref, visible, k, c)))


def test_interpreter_child():
    run_interpreter_tests(__file__, qsa_score._INTERPRETED)


def test_qsa_block_scores_reference_against_direct_dot():
    gen = torch.Generator().manual_seed(1)
    c, bs, H, D = 4, 16, 3, 8
    lens = [70, 9]
    q, keys, tables, visible = _paged_index(lens, H, D, c, bs, torch.float32, gen)
    s = qsa_block_scores_ref(q, keys, tables, visible, 20, c, bs)
    n, g = 0, 13                                      # token 52: KV block 3, its second index row
    row = int(tables[n, 3]) * (bs // c) + 1
    assert torch.allclose(s[n, g], (q[n] @ keys[row]).relu().sum() / D ** 0.5, atol=1e-6)
    assert torch.isfinite(s[0, :17]).all() and torch.isinf(s[0, 17:]).all()
    assert torch.isfinite(s[1, :2]).all() and torch.isinf(s[1, 2:]).all()


def test_select_blocks_equals_select_positions():
    """Rows with no complete block (visible < c), fewer complete blocks than block_topk, exactly block_topk,
    and every block of G; continuous random scores (no ties)."""
    gen = torch.Generator().manual_seed(0)
    c, G = 4, 300
    visible = torch.tensor([0, 1, 3, 4, 7, 40, 63, 64, 65, 66, 67, 500, 1199, 1200, 1203])
    scores = _masked_random_scores(visible, G, c, gen)
    for k in (0, 1, 16, 299, 300, 400):
        idx, counts = select_blocks(scores, visible, k, c)
        ref_idx, ref_counts = select_positions(scores, visible, k, c)
        assert idx.dtype == ref_idx.dtype == torch.int32 and counts.dtype == torch.int32
        assert torch.equal(idx, ref_idx) and torch.equal(counts, ref_counts)
    assert idx[1, 0] == 0 and (idx[1, 1:] == SENTINEL).all() and counts[0] == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_qsa_block_scores_1m():
    """The H200 shape (indexer 16 x 128, c = 4, block_size 64, bf16, budget 2048 = 512 blocks), 8 rows of
    ~1M tokens (G = 256K blocks): kernel scores within fp32 accumulation order of the reference, and the
    selections agree on >= 99.9% of the picked tokens (only near-ties at the k-th score may swap)."""
    gen = torch.Generator().manual_seed(7)
    c, bs, H, D, block_topk = 4, 64, 16, 128, 512
    lens = [2**20 - 977 * b for b in range(8)]
    q, keys, tables, visible = _paged_index(lens, H, D, c, bs, torch.bfloat16, gen, device="cuda")
    G = tables.shape[1] * bs // c
    out = qsa_block_scores(q, keys, tables, visible, G, c, bs)
    ref = qsa_block_scores_ref(q, keys, tables, visible, G, c, bs)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    idx, counts = select_blocks(out, visible, block_topk, c)
    ref_idx, ref_counts = select_positions(ref, visible, block_topk, c)
    assert torch.equal(counts, ref_counts)
    same = sum(len(set(a[:n].tolist()) & set(b[:n].tolist())) for a, b, n in
               zip(idx.cpu(), ref_idx.cpu(), counts.tolist()))
    assert same >= 0.999 * int(counts.sum())
