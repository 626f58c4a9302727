"""Native GGUF runs (here) against the transformers-converted runs (../2026-12-04-smollm2-quality/) on the same
samples: prints the Markdown tables of README.md. python compare.py"""
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OLD = os.path.join(HERE, "..", "2026-12-04-smollm2-quality")
# (title, native run, converted run, length)
PAIRS = [("8K, seed 0", "sweep-8k-seed0", "sweep-8k", "8192"),
         ("8K, seed 1", "sweep-8k-seed1", "sweep-8k-seed1", "8192"),
         ("4K, seed 0", "sweep-4k-seed0", "sweep-4k", "4096")]
ROWS = ["floor:bf16", "oracle-shared-k64", "sketch32-shared-k64", "oracle-shared-k128", "sketch32-shared-k128",
        "tier-k8v4-r32-k128"]


def load(d, name):
    with open(os.path.join(d, name + ".json")) as f:
        j = json.load(f)
    return j, np.load(os.path.join(d, name + "_tokens.npz"))


def cell(j, row, L):
    e = j["configs"].get(row)
    if e is None:
        return None
    s = e["by_length"][L]
    return s["kl_mean"], s["top1"], s["frac_read"]


def main():
    for title, new, old, L in PAIRS:
        jn, tn = load(HERE, new)
        jo, to = load(OLD, old)
        sn, so = jn["lengths"][L]["starts"][0], jo["lengths"][L]["starts"][0]
        floor = cell(jn, "floor:bf16", L)[0]
        print(f"\n{title}: sample start (token index) native {sn}, converted {so}\n")
        print("| configuration | read | native KL / top-1 | x floor | converted KL / top-1 | per-token max abs diff |")
        print("|---|---:|---:|---:|---:|---:|")
        for row in ROWS:
            n, o = cell(jn, row, L), cell(jo, row, L)
            if n is None:
                continue
            key = f"{row}|{L}-0"
            diff = f"{np.abs(tn[key] - to[key]).max():.1e}" if key in to else "–"
            conv = f"{o[0]:.4g} / {o[1]:.1%}" if o else "–"
            print(f"| {row} | {n[2]:.2%} | {n[0]:.4g} / {n[1]:.1%} | {n[0] / floor:.1f}x | {conv} | {diff} |")
    j, _ = load(HERE, "sweep-8k-seed1-native-basis")
    jo, _ = load(HERE, "sweep-8k-seed1")
    print("\n8K, seed 1, basis fitted through the GGUF loader vs the converted model's basis\n")
    print("| configuration | native basis KL / top-1 | converted basis KL / top-1 |")
    print("|---|---:|---:|")
    for row in ROWS:
        n, o = cell(j, row, "8192"), cell(jo, row, "8192")
        if n:
            print(f"| {row} | {n[0]:.4g} / {n[1]:.1%} | {o[0]:.4g} / {o[1]:.1%} |")


if __name__ == "__main__":
    main()
