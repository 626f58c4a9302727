"""Study (issue 41): the selection's top-k in fewer launches.

The engine's top-k (ops/topk.py, `topk_positions`) per decode step, full-attention layer and read group: a radix
select's four histogram passes over the scores, a count and an ordered compaction. Until session 36 each round had
a one-program pick kernel after it (11 launches per call: 352 of a 27B step's ~1,800 kernels at 8 x 250K, 1.46 ms
on H100 run 119); now the next kernel's programs read the digits out of the earlier rounds' histograms themselves
(7 launches). Here, per shape: every path's picks against the PyTorch version (bit for bit), then CUDA-graph replay
times of

    engine      topk_positions: 7 launches (count and compaction derive the k-th value from the histograms)
    kth kernel  topk_positions_triton(kth=kth_largest_triton): the histograms, one kernel writing the k-th values,
                count, compaction (8 launches)
    torch       topk_positions_torch (torch.topk + cumsum + scatter)

against the floor of reading the scores once (rows x N x 4 B / HBM copy bandwidth measured here). Session 36 tried
and dropped a one-launch version (the programs of a row meeting at atomic-counter barriers between the rounds):
slower (62.5 / 108.4 us at 4 / 8 x 250K against 51.4 / 69.6 for the 11 launches, H100 run 121), a round's few
programs per row having too few loads in flight.

    python benchmarks/studies/topk_launches.py --out /tmp/topk.json
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_sparse_ops import bench, copy_bw, graphed  # noqa: E402
from sketchkv.ops.topk import kth_largest_triton, topk_positions, topk_positions_torch, topk_positions_triton  # noqa: E402

SENTINEL = 2**31 - 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4x250000", "8x250000", "4x131072", "32x250000"],
                   help="ROWSxN (a read group of 4 agents at 250K, all 8, ...)")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    bw = copy_bw() / 1e9
    res = {"device": torch.cuda.get_device_name(), "copy_gbps": bw, "k": a.k, "shapes": []}
    names = ("engine", "kth kernel", "torch")
    torch.manual_seed(0)
    for shape in a.shapes:
        rows, N = map(int, shape.split("x"))
        s = torch.randn(rows, N, device="cuda")
        s[:, :64] = float("-inf")
        s[:, -1024:] = float("-inf")
        ref = topk_positions_torch(s, a.k, SENTINEL)
        fns = (lambda: topk_positions(s, a.k, SENTINEL),
               lambda: topk_positions_triton(s, a.k, SENTINEL, kth=kth_largest_triton),
               lambda: topk_positions_torch(s, a.k, SENTINEL))
        row = {"rows": rows, "N": N, "floor_us": rows * N * 4 / (bw * 1e9) * 1e6}
        for name, fn in zip(names, fns):
            row[name + "_equal"] = bool(torch.equal(fn(), ref))
            row[name + "_us"] = bench(graphed(fn)) * 1e6
        res["shapes"].append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{res['device']}, HBM copy {bw:.0f} GB/s, k = {a.k}; us per call (CUDA-graph replay), (x) = floor / time")
    print("| rows x N | " + " | ".join(names) + " | all equal |")
    print("|---|---|---|---|---|")
    for r in res["shapes"]:
        cells = [f"{r[m + '_us']:.1f} ({r['floor_us'] / r[m + '_us']:.0%})" for m in names]
        print(f"| {r['rows']} x {r['N']} | " + " | ".join(cells) + f" | {all(r[m + '_equal'] for m in names)} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
