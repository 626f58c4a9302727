import sys, torch, triton
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from bench_sparse_ops import bench, copy_bw
from sketchkv.ops.sketch import quantize_int4, sketch_score_dp4a, sketch_score_triton
B, L, Hkv, r, bs = 8, 250_000, 4, 64, 64
torch.manual_seed(0)
bw = copy_bw()
nblk = B * triton.cdiv(L, bs) + 1
tables = (torch.randperm(nblk - 1, device="cuda")[: B * triton.cdiv(L, bs)] + 1).int().view(B, -1)
lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
lens[1::2] -= torch.randint(0, L // 4, (B // 2,), device="cuda", dtype=torch.int32)
sk, sc = quantize_int4(torch.randn(nblk, bs, Hkv, r, device="cuda"))
max_len = tables.shape[1] * bs
q = torch.randn(B, Hkv, r, device="cuda") * 2
floor = (int(lens.sum()) * Hkv * (r // 2 + 2) + B * max_len * 4) / bw
ref = sketch_score_dp4a(q, sk, sc, tables, lens, 64, 1024, max_len, True, "sum", bpp=2, num_warps=4)
t = bench(lambda: sketch_score_triton(q, sk, sc, tables, lens, 64, 1024, max_len, True, "sum"))
print(f"copy {bw/1e9:.0f} GB/s floor {floor*1e6:.1f} us; fma {t*1e6:.1f} us ({floor/t:.0%})")
for bpp, nw in ((2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8), (16, 16)):
    f = lambda: sketch_score_dp4a(q, sk, sc, tables, lens, 64, 1024, max_len, True, "sum", bpp=bpp, num_warps=nw)
    same = torch.equal(f(), ref)
    t = bench(f)
    print(f"dp4a bpp {bpp:2d} warps {nw:2d}: {t*1e6:6.1f} us ({floor/t:.0%}) same {same}")
