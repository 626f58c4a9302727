"""Sketch scoring kernels on a GPU: every (kernel, blocks per program, warps) tile, against the bytes
floor at the HBM copy bandwidth measured in the same run, after a correctness check of each tile
against the PyTorch reference on fresh random inputs.

    python benchmarks/bench_sketch_score.py --out benchmarks/results/sketch-score.json [--quick]

Shape: one Qwen3.5-27B full-attention layer at batch 8 x 250K tokens (4 KV heads, rank-64 int4 sketch,
block size 64, 64 sinks + 1,024 recent excluded), the engine's calls: `sum` scores the group-summed
query ([B, Hkv, r]: one dot per KV head), `softmax` every query head ([B, Hkv, 6, r]): kernel `dot` scores the
sketch once and stores fp16 per-head scores for its second pass, `dot2` (two_pass=True) and `fma` score it
twice; `dot1p` scores it once after a pass over every 16th position for the heads' normalizers
(`--sparse-softmax-lse-stride`; checked against the sampled reference); `dp4a` scores in integers (int8 query
codes, checked against the reference on the dequantised codes; softmax: stored fp16 head scores, as `dot`); `max` every query head, as the engine does. Times: each call replayed from a CUDA graph
(the engine's way; eager times are kept beside them). Floor: the sketch read once + one fp32 score per token
written, at the copy bandwidth (2 x bytes / time of a 1 GiB device copy), for every kernel (what a one-pass kernel
would move). Goal (issue 4): >= 70%.
Then the top-k threshold over the step's [B, max_len] scores: radix select (kth_largest_triton) against
torch.topk (kth_largest_torch, which sorts such rows), and the whole topk_positions.
"""
import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_ops import bench, copy_bw, graphed  # noqa: E402
from sketchkv.ops.sketch import (quantize_int4, quantize_query_int8, sketch_score_dot, sketch_score_dp4a,  # noqa: E402
                                  sketch_score_ref, sketch_score_triton)
from sketchkv.ops.topk import (kth_largest_torch, kth_largest_triton, topk_positions,  # noqa: E402
                               topk_positions_triton)

LSE_STRIDE = 16   # dot1p: the softmax normalizers from every 16th position (~15,600 per head at 250K)


def kernel_times(fn, calls: int = 20) -> dict:
    """GPU time per call of each kernel fn launches (torch.profiler), to split a softmax scoring into its passes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            out[e.key[:48]] = e.self_device_time_total / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=250_000)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="the best tiles of the full sweep (H200 runs 17, 28, 42) only")
    p.add_argument("--out", default="benchmarks/results/sketch-score.json")
    p.add_argument("--profile", action="store_true",
                   help="only run the engine's scoring calls three times each (softmax: the dot kernel; sum: the fma and "
                        "the dp4a kernels), for a profiler: ncu --clock-control none -k regex:_sketch_score_dot_kernel --launch-skip 2 "
                        "--launch-count 1 python3 %(prog)s --profile (-k regex:^_sketch_score_kernel for the fma one, "
                        "-k regex:_dp4a for the integer one)")
    p.add_argument("--kernels", nargs="*", default=None, metavar="NAME",
                   help="time only these kernels (fma, dot, dot_ops, dot2, dot1p, dp4a; default: all)")
    p.add_argument("--maxnreg", type=int, nargs="*", default=[],
                   help="also time the softmax dot kernel (best tile) with these register caps per thread")
    a = p.parse_args()
    B, L, Hq, Hkv, r, bs, sinks, recent = a.batch, a.context, 24, 4, a.rank, 64, 64, 1024
    G = Hq // Hkv
    torch.manual_seed(0)
    bw = copy_bw()
    nblk = B * triton.cdiv(L, bs) + 1
    tables = (torch.randperm(nblk - 1, device="cuda")[: B * triton.cdiv(L, bs)] + 1).int().view(B, -1)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    lens[1::2] -= torch.randint(0, L // 4, (B // 2,), device="cuda", dtype=torch.int32)   # ragged lengths
    sk, sc = quantize_int4(torch.randn(nblk, bs, Hkv, r, device="cuda"))
    max_len = tables.shape[1] * bs
    q_sum = torch.randn(B, Hkv, r, device="cuda") * 2
    q_heads = torch.randn(B, Hkv, G, r, device="cuda") * 2
    sm = 256 ** -0.5
    if a.profile:
        for _ in range(3):
            sketch_score_dot(q_heads, sk, sc, tables, lens, sinks, recent, max_len, True, "softmax", 256 ** -0.5)
        for _ in range(3):
            sketch_score_triton(q_sum, sk, sc, tables, lens, sinks, recent, max_len, True, "sum")
        for _ in range(3):
            sketch_score_dp4a(q_sum, sk, sc, tables, lens, sinks, recent, max_len, True, "sum")
        torch.cuda.synchronize()
        return
    tokens = int(lens.sum())
    read = tokens * Hkv * (r // 2 + 2)
    # the engine's calls: sum scores the group-summed query, max / softmax every query head
    cases = {"sum": (q_sum, "sum"), "max": (q_heads, "max"), "softmax": (q_heads, "softmax")}
    floors = {name: (read + B * max_len * 4) / bw for name in cases}
    refs, refs_dp4a = {}, {}
    for name, (q, combine) in cases.items():   # reference on two sequences (one full, one ragged)
        refs[name] = sketch_score_ref(q[:2], sk, sc, tables[:2], lens[:2], sinks, recent, max_len, True, combine, sm)
        codes, qscale = quantize_query_int8(q[:2])   # dp4a: the reference on the dequantised int8 codes
        refs_dp4a[name] = sketch_score_ref(codes.float() * qscale[..., None], sk, sc, tables[:2], lens[:2], sinks,
                                           recent, max_len, True, combine, sm)

    refs["softmax-sampled"] = sketch_score_ref(q_heads[:2], sk, sc, tables[:2], lens[:2], sinks, recent, max_len, True,
                                               "softmax", sm, lse_stride=LSE_STRIDE)

    def dot2(*args, **kw):
        return sketch_score_dot(*args, **kw, two_pass=True)

    def dot_ops(*args, **kw):
        return sketch_score_dot(*args, **kw, unpack="ops")

    def dot1p(*args, **kw):
        return sketch_score_dot(*args, **kw, lse_stride=LSE_STRIDE)

    # dot: the int4 nibbles unpacked by PTX (the default on CUDA); dot_ops: by Triton ops (session 12's kernel)
    # dp4a: in integers (int8 query codes); checked against the reference on the dequantised codes
    # dot1p: softmax in one scoring pass, the normalizers sampled first (checked against the sampled reference)
    kernels = {"fma": sketch_score_triton, "dot": sketch_score_dot, "dot_ops": dot_ops, "dot2": dot2,
               "dot1p": dot1p, "dp4a": sketch_score_dp4a}
    dot_tiles = [(1, 4), (2, 4), (2, 8)] if a.quick else [(1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (1, 8)]
    tiles = {"fma": [(1, 2)] if a.quick else [(1, 2), (1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16)],
             "dot": dot_tiles, "dot_ops": dot_tiles, "dot2": [(2, 4)], "dot1p": dot_tiles,
             "dp4a": [(1, 2), (2, 4), (4, 4)] if a.quick else [(1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8)]}
    rows = []
    for name, (q, combine) in cases.items():
        for kname, fn in kernels.items():
            if ((kname in ("dot2", "dot1p") and combine != "softmax")
                    or (a.kernels is not None and kname not in a.kernels)):
                continue
            ref = refs_dp4a[name] if kname == "dp4a" else refs["softmax-sampled"] if kname == "dot1p" else refs[name]
            fin = torch.isfinite(ref)
            for bpp, nw in tiles[kname]:
                def call():
                    return fn(q, sk, sc, tables, lens, sinks, recent, max_len, True, combine, sm, bpp=bpp, num_warps=nw)
                try:
                    out = call()
                except Exception as e:  # a tile that does not compile (registers, shared memory) is reported
                    rows.append(dict(case=name, kernel=kname, bpp=bpp, warps=nw, error=str(e).split("\n")[0][:200]))
                    print(f"{name:8s} {kname} bpp {bpp} warps {nw}: {rows[-1]['error']}")
                    continue
                o = out[:2]
                same_inf = bool(torch.equal(torch.isinf(o), torch.isinf(ref)))
                err = ((o[fin] - ref[fin]).abs() / (1 + ref[fin].abs())).max().item()
                # timed replayed from a CUDA graph, as the engine runs it: eager timing also counts the host's
                # launch overhead whenever it exceeds the GPU work in flight (H200 run 86: 91 us under ncu, 222 us
                # eager for a call of two launches)
                te, t = bench(call), bench(graphed(call))
                rows.append(dict(case=name, kernel=kname, bpp=bpp, warps=nw, us=t * 1e6, eager_us=te * 1e6,
                                 floor_us=floors[name] * 1e6, fraction_of_copy=floors[name] / t, max_rel_err=err,
                                 same_masked=same_inf))
                print(f"{name:8s} {kname} bpp {bpp} warps {nw:2d}: {t * 1e6:7.1f} us (eager {te * 1e6:.1f}), floor "
                      f"{floors[name] * 1e6:.0f} us ({floors[name] / t:.0%}), rel err {err:.1e}, masks equal {same_inf}")
    # In the engine these run inside CUDA graphs: the same calls replayed from graphs (launch gaps without the
    # eager host overhead of the small torch ops between kernels).
    best = {}
    for kname in ("dot", "dot_ops", "dot2", "dot1p", "dp4a"):
        if a.kernels is not None and kname not in a.kernels:
            continue
        ok = [x for x in rows if x["case"] == "softmax" and x["kernel"] == kname and "us" in x]
        if ok:
            bpp, nw = min(ok, key=lambda x: x["us"])["bpp"], min(ok, key=lambda x: x["us"])["warps"]
            call = (lambda fn=kernels[kname], bpp=bpp, nw=nw: fn(q_heads, sk, sc, tables, lens, sinks, recent, max_len,
                                                                  True, "softmax", sm, bpp=bpp, num_warps=nw))
            best[kname] = dict(bpp=bpp, warps=nw, graph_us=bench(graphed(call)) * 1e6)
            print(f"softmax {kname} bpp {bpp} warps {nw} in a CUDA graph: {best[kname]['graph_us']:.1f} us")
            best[kname]["kernels_us"] = kernel_times(call)
            print("   per kernel (us per call): " + ", ".join(f"{n} {u:.1f}" for n, u in best[kname]["kernels_us"].items()))

    # register caps: occupancy against spills, for the softmax dot kernel's best tile
    caps = []
    ok = [x for x in rows if x["case"] == "softmax" and x["kernel"] == "dot" and "us" in x]
    if a.maxnreg and ok:
        b0 = min(ok, key=lambda x: x["us"])
        ref = refs["softmax"]
        fin = torch.isfinite(ref)
        for cap in a.maxnreg:
            def call(cap=cap):
                return sketch_score_dot(q_heads, sk, sc, tables, lens, sinks, recent, max_len, True, "softmax", sm,
                                        bpp=b0["bpp"], num_warps=b0["warps"], maxnreg=cap)
            try:
                o = call()[:2]
            except Exception as e:  # an option this Triton does not take, or a cap ptxas refuses
                caps.append(dict(maxnreg=cap, error=str(e).split("\n")[0][:200]))
                print(f"softmax dot maxnreg {cap}: {caps[-1]['error']}")
                continue
            err = ((o[fin] - ref[fin]).abs() / (1 + ref[fin].abs())).max().item()
            caps.append(dict(maxnreg=cap, bpp=b0["bpp"], warps=b0["warps"], us=bench(call) * 1e6, max_rel_err=err,
                             graph_us=bench(graphed(call)) * 1e6, kernels_us=kernel_times(call)))
            print(f"softmax dot bpp {b0['bpp']} warps {b0['warps']} maxnreg {cap}: {caps[-1]['us']:.1f} us "
                  f"(graph {caps[-1]['graph_us']:.1f}; default {b0['us']:.1f}), rel err {err:.1e}; "
                  + ", ".join(f"{n} {u:.1f}" for n, u in caps[-1]["kernels_us"].items()))

    # top-k threshold over one layer's scores (the engine's shared selection: one row per sequence)
    scores = sketch_score_dot(q_heads, sk, sc, tables, lens, sinks, recent, max_len, True, "softmax", sm)[:, 0]
    k = 2048
    kth_same = bool(torch.equal(kth_largest_triton(scores, k), kth_largest_torch(scores, k)))
    topk = {"k": k, "kth_bitwise_equal": kth_same, "scores_read_floor_us": scores.numel() * 4 / bw * 1e6}
    for name, fn in (("kth_radix", lambda: kth_largest_triton(scores, k)), ("kth_torch", lambda: kth_largest_torch(scores, k)),
                     ("topk_positions", lambda: topk_positions(scores, k, -1)),
                     ("topk_positions_torch_kth", lambda: topk_positions_triton(scores, k, -1, kth=kth_largest_torch))):
        topk[name + "_us"] = bench(fn) * 1e6
        topk[name + "_graph_us"] = bench(graphed(fn)) * 1e6
    print(f"top-k {k} over {B} x {max_len} (eager / CUDA graph, us): radix select {topk['kth_radix_us']:.1f} / "
          f"{topk['kth_radix_graph_us']:.1f}, torch.topk {topk['kth_torch_us']:.1f} / {topk['kth_torch_graph_us']:.1f} "
          f"(equal: {kth_same}); topk_positions {topk['topk_positions_us']:.1f} / {topk['topk_positions_graph_us']:.1f} "
          f"(with torch.topk: {topk['topk_positions_torch_kth_us']:.1f} / {topk['topk_positions_torch_kth_graph_us']:.1f}); "
          f"one read of the scores {topk['scores_read_floor_us']:.1f}")
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M"), command=" ".join(sys.argv), copy_GBps=bw / 1e9,
               shape=dict(batch=B, context=L, tokens=tokens, Hq=Hq, Hkv=Hkv, rank=r, block=bs), rows=rows, softmax_graph=best, maxnreg=caps, topk=topk)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nHBM copy {bw / 1e9:.0f} GB/s; {B} x {L} tokens (ragged: {tokens} in all), rank {r}")
    print("| case | kernel | best tile (bpp x warps) | us | floor us | of copy bw |")
    print("|---|---|---|---|---|---|")
    for name in cases:
        for kname in kernels:
            ok = [x for x in rows if x["case"] == name and x["kernel"] == kname and "us" in x]
            if ok:
                best = min(ok, key=lambda x: x["us"])
                print(f"| {name} | {kname} | {best['bpp']} x {best['warps']} | {best['us']:.0f} | {best['floor_us']:.0f} | "
                      f"{best['fraction_of_copy']:.0%} |")


if __name__ == "__main__":
    main()
