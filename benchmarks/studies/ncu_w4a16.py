"""Nsight Compute target: one _w4a16_kernel launch per 27B shape at M = 8 (and bf16 cuBLAS beside it), each
after a warm call that compiles it. Run under `ncu --kernel-name regex:'_w4a16|nvjet|gemm' ...`."""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.bench_w4a16_gemm import SHAPES, make_weight  # noqa: E402
from sketchkv.ops.w4a16_gemm import config_for, w4a16_matmul  # noqa: E402

M = int(sys.argv[1]) if len(sys.argv) > 1 else 8
for name, (K, N, _) in SHAPES.items():
    w, wd = make_weight(K, N, 128)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    torch.cuda.nvtx.range_push(f"{name} warm")
    w4a16_matmul(x, w)
    F.linear(x, wd)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_push(f"{name} M={M} {config_for(M, N, K, x.device)}")
    w4a16_matmul(x, w)
    F.linear(x, wd)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(name, K, N, config_for(M, N, K, x.device), flush=True)
