"""Compile the sketch-scoring kernels for an H200 (sm_90) on a machine without a GPU and count what their PTX
does per thread: global loads (scalar vs 16-byte vectors), shared-memory traffic and barriers (layout
conversions, cross-warp reductions), conversions, FMAs, exp2. A cheap first look before spending device time:
session 6 found the old kernel's 130 scalar q loads and int-to-float conversions this way.

    python scripts/sketch_kernel_ptx.py                      # 27B shape: 4 KV heads, rank 64, block 64
    python scripts/sketch_kernel_ptx.py --tiles 1x2 2x4 --modes sum softmax2

Uses the fake sm_90 driver of tests/triton_compile_check.py (the wheel's ptxas, no GPU).
"""
import argparse
import collections
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

MODES = {"sum": (0, 1), "softmax1": (2, 6), "softmax2": (3, 6)}   # name -> (kernel MODE, query heads per KV head)
KEEP = ("cvt", "ld.global", "ld.shared", "st.shared", "bar", "fma", "add.f32", "and.b32", "or.b32", "ex2", "shfl")


def compile_score(kernel, mode: int, G: int, bpp: int, warps: int, kv_heads: int, rank: int, block: int):
    t = lambda dt: torch.empty(64, dtype=dt)  # noqa: E731  (only dtype and alignment matter)
    args = [t(torch.float32), t(torch.uint8), t(torch.float16), t(torch.int32), t(torch.int32), t(torch.float32),
            t(torch.float32), 64, 1024, 256000, 4000, 0.5] + [16] * 10
    gp = max(16, 1 << (G - 1).bit_length())
    return kernel.warmup(*args, grid=(1,), HKV=kv_heads, R=rank, BS=block, BPP=bpp, G=G, GP=gp, MODE=mode,
                         SHARED=True, num_warps=warps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", nargs="+", default=["1x2", "1x4", "2x4", "2x8"], help="blocks-per-program x warps")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--kernels", nargs="+", default=["fma", "dot"], choices=["fma", "dot"])
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    a = p.parse_args()
    from triton.runtime import driver
    from triton_compile_check import _FakeCudaDriver
    driver.set_active(_FakeCudaDriver())
    from sketchkv.ops import sketch
    kernels = {"fma": sketch._sketch_score_kernel, "dot": sketch._sketch_score_dot_kernel}
    for kname in a.kernels:
        for mname in a.modes:
            mode, G = MODES[mname]
            for tile in a.tiles:
                bpp, warps = map(int, tile.split("x"))
                ck = compile_score(kernels[kname], mode, G, bpp, warps, a.kv_heads, a.rank, a.block)
                ops = collections.Counter(re.findall(r"^\s+(?:@%p\d+\s+)?([a-z][\w.]*)", ck.asm["ptx"], re.M))
                counts = {k: v for k, v in sorted(ops.items()) if k.startswith(KEEP)}
                print(f"{kname} {mname:8s} tile {tile:4s} shared {ck.metadata.shared:6d} B  {counts}")


if __name__ == "__main__":
    main()
