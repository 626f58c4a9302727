"""Study (issue 41): what a CUDA graph's launch costs the host, by kernel count and by how many streams the graph
forks to. The 8 x 250K decode step (H100 run 121) spends ~2.9 ms per step outside its graph's span (the lm_head
GEMM is 0.9 of it), and the profiled step shows the GPU idle 2.86 ms between the step's input copy and the graph's
first kernel: if `graph.replay()` itself holds the host that long, fewer kernels (or fewer fork / join points)
are what shortens it, not faster input staging.

    python benchmarks/studies/graph_launch.py --out benchmarks/results/DATE-graph-launch

Graphs of N tiny kernels (an in-place add on 256 floats) on one stream, or forked every F kernels to a side stream
(round robin over S side streams, each fork an event wait and a join back, as the engine's read groups and host
admits do). Per graph: host us inside `replay()` (perf_counter around the call, no sync; median of reps), and the
replay's wall time to a device sync. Prints a table; --out writes graph_launch.json / .md.
"""
import argparse
import json
import os
import statistics
import time

import torch


def build(n: int, fork_every: int, side: int):
    """A graph of n kernels; every fork_every kernels one more runs on a side stream (fork, kernel, join)."""
    dev = torch.device("cuda")
    xs = [torch.randn(256, device=dev) for _ in range(4)]
    streams = [torch.cuda.Stream() for _ in range(side)]

    def body():
        main = torch.cuda.current_stream()
        k = 0
        for i in range(n):
            if fork_every and i % fork_every == fork_every - 1:
                s = streams[k % side]
                k += 1
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    xs[1].add_(1.0)
                main.wait_stream(s)
            else:
                xs[0].add_(1.0)
    s0 = torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        body()   # warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def measure(g, reps: int) -> dict:
    g.replay()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(1e6 * (t1 - t0))
        wall.append(1e6 * (t2 - t0))
    return {"launch_us": statistics.median(host), "launch_us_min": min(host), "wall_us": statistics.median(wall)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, nargs="+", default=[100, 400, 1400])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    patterns = [("one stream", 0, 1), ("fork every 20, 1 side stream", 20, 1), ("fork every 20, 4 side streams", 20, 4),
                ("fork every 5, 4 side streams", 5, 4)]
    rows = []
    for n in a.kernels:
        for name, fe, side in patterns:
            r = {"kernels": n, "pattern": name, **measure(build(n, fe, side), a.reps)}
            rows.append(r)
            print(f"{n:5d} kernels, {name:30s}: launch {r['launch_us']:8.1f} us (min {r['launch_us_min']:.1f}), "
                  f"replay to sync {r['wall_us']:8.1f} us", flush=True)
    md = [f"# CUDA graph launch cost on the host: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
          "| kernels | pattern | host us in replay() (median) | us per kernel | replay to sync us |", "|---|---|---|---|---|"]
    md += [f"| {r['kernels']} | {r['pattern']} | {r['launch_us']:.1f} | {r['launch_us'] / r['kernels']:.2f} | "
           f"{r['wall_us']:.1f} |" for r in rows]
    print("\n".join(md))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(os.path.join(a.out, "graph_launch.json"), "w"),
                  indent=1)
        open(os.path.join(a.out, "graph_launch.md"), "w").write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
