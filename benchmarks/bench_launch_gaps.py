"""What a dependent kernel boundary costs inside a CUDA graph, with and without programmatic dependent launch
(PDL, Hopper: the next kernel is launched while the previous one drains and waits in `griddepcontrol.wait`).

    python benchmarks/bench_launch_gaps.py --out /tmp/gaps.json

The 27B decode step runs ~1,220 dependent kernels on its main stream and waits 3.35 ms between them (H200 run 94:
2.7 us per boundary). Chains measured here, each replayed from a CUDA graph (median of 20 replays):
  tiny     N dependent Triton kernels on one decode-step activation (8 x 5120 bf16): y = x * a + 1, ping-pong;
  gemm     N x (one such kernel + an 8-row GEMM of a 5120 x 5120 weight, a different weight each time: no L2 reuse),
           the cuBLAS kernels never PDL-launched (torch launches them), the Triton ones with or without PDL.
Each chain's result is checked against the same arithmetic in torch.
"""
import argparse
import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from benchmarks.bench_sparse_ops import graphed  # noqa: E402
from benchmarks.bench_weight_gemms import replay_us  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()            # the previous kernel's writes are visible after this
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()   # the next kernel may start its launch now
    tl.store(y_ptr + offs, (x * a + 1.0).to(y_ptr.dtype.element_ty), mask=offs < n)


def axpb(x, y, a: float, pdl: bool):
    n = x.numel()
    _axpb_kernel[(triton.cdiv(n, 1024),)](x, y, n, a, PDL=pdl, BLOCK=1024, launch_pdl=pdl)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=1000, help="length of the tiny chain")
    p.add_argument("--gemms", type=int, default=64, help="(kernel + GEMM) pairs of the gemm chain")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    x0 = torch.randn(8, 5120, device=dev, dtype=torch.bfloat16)
    bufs = [x0.clone(), torch.empty_like(x0)]
    Ws = [torch.randn(5120, 5120, device=dev, dtype=torch.bfloat16) / 80 for _ in range(args.gemms)]
    res = {}

    def tiny(pdl):
        for i in range(args.kernels):
            axpb(bufs[i % 2], bufs[(i + 1) % 2], 0.5, pdl)

    def gemm(pdl):
        for i in range(args.gemms):
            axpb(bufs[0], bufs[1], 0.5, pdl)
            torch.mm(bufs[1], Ws[i].t(), out=bufs[0])

    for name, fn, n in (("tiny", tiny, args.kernels), ("gemm", gemm, args.gemms)):
        for pdl in (False, True):
            bufs[0].copy_(x0)
            replay = graphed(lambda: fn(pdl))   # graphed() runs fn once to warm up, then captures it
            bufs[0].copy_(x0)
            replay()
            torch.cuda.synchronize()
            got = bufs[args.kernels % 2 if name == "tiny" else 0].float()
            ref = x0.clone()
            for i in range(n):       # the same arithmetic in torch, bf16 between kernels
                ref = (ref.float() * 0.5 + 1.0).to(torch.bfloat16)
                if name == "gemm":
                    ref = torch.mm(ref, Ws[i].t())
            err = ((got - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
            us = replay_us(replay)
            res[f"{name}{'-pdl' if pdl else ''}"] = {"us": us, "per_step_us": us / n, "rel_err": err}
            print(f"{name:5s} pdl={pdl!s:5s} {n:5d} steps: {us:9.1f} us, {us / n:6.2f} us per step, rel err {err:.1e}",
                  flush=True)
    gemm_bytes = 5120 * 5120 * 2
    bw = hbm_bandwidth(torch.device(dev), 1.0)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s: one GEMM's weight reads in {gemm_bytes / bw * 1e6:.1f} us")
    print("| chain | us per step, no PDL | with PDL | saved per boundary |\n|---|---|---|---|")
    for name, per in (("tiny", 1), ("gemm", 2)):
        a, b = res[name]["per_step_us"], res[name + "-pdl"]["per_step_us"]
        print(f"| {name} | {a:.2f} | {b:.2f} | {(a - b) / per:.2f} |")
    if args.out:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "results": res, "args": vars(args)},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
