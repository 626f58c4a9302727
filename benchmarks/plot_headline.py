"""The README's figure: decode tok/s by agents x context, sketchkv sparse + host tier vs sketchkv dense vs
transformers, and sparse with W4A16 weights where measured, one H200, Qwen3.5-27B shape (random weights). Reads only committed results; writes a PNG.

    python benchmarks/plot_headline.py            # -> docs/img/agents-headline.png

Each bar is one row of a committed `sketchkv bench agents` JSON (named on the plot and in POINTS below). A
configuration with no bar at a point either does not fit in the GPU's memory there (the benchmark's own memory
arithmetic, the JSON's `capacity` table) or was not measured; the plot says which.
"""
import argparse
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(REPO, "benchmarks", "results")

# (label, agents, context, {config: (result JSON relative to benchmarks/results, run)})
POINTS = [
    ("1 x 128K", 1, 131072, {c: ("agents-2026-12-04/agents-2026-12-04.json", "run 73") for c in ("sparse", "dense", "hf")}),
    ("8 x 128K", 8, 131072, {"sparse": ("agents-2026-12-02/agents-2026-12-02.json", "run 52")}),
    ("8 x 250K", 8, 256000, {"sparse": ("agents-2026-12-04/agents-2026-12-04.json", "run 93"),
                             "sparse-w4a16": ("2026-12-04-h200-run99-w4a16-agents/a8-w4a16.json", "run 99")}),
    ("14 x 250K", 14, 256000, {"sparse": ("2026-12-02-h200-run45/agents-max.json", "run 45")}),
]
CAPACITY = "agents-2026-12-04/agents-2026-12-04.json"   # dense / hf capacity at 128K, from the memory arithmetic
CONFIGS = [("sparse", "sketchkv sparse + host tier (int4 rows)", "#1f77b4"),
           ("sparse-w4a16", "sketchkv sparse + host tier, W4A16 (int4) weights", "#2ca02c"),
           ("dense", "sketchkv dense (bf16 KV on the GPU)", "#ff7f0e"),
           ("hf", "Hugging Face transformers 5.17 + fla", "#7f7f7f")]


def _row(path: str, config: str, agents: int, context: int) -> dict:
    """The first ok row of that configuration and point (the default head combine where several exist)."""
    for r in json.load(open(os.path.join(RES, path)))["rows"]:
        if (r["config"], r["agents"], r["context"], r["status"]) == (config, agents, context, "ok") \
                and "--sparse-head-combine" not in r.get("command", ""):
            return r
    raise SystemExit(f"{path}: no ok {config} row at {agents} x {context}")


def _max_agents(config: str, context: int) -> int | None:
    """How many agents of `context` tokens fit on the GPU (the benchmark's arithmetic at 128K, scaled by the KV
    bytes for longer contexts: dense KV grows with the context, weights do not)."""
    cap = {(c["config"], c["context"]): c for c in json.load(open(os.path.join(RES, CAPACITY)))["capacity"]}
    c = cap.get((config, 131072))
    if c is None:
        return None
    return int(c["max_agents"] * 131072 // context) if context > 131072 else c["max_agents"]


def data() -> list[dict]:
    out = []
    for label, agents, context, sources in POINTS:
        bars = {}
        for config, _, _ in CONFIGS:
            if config in sources:
                path, run = sources[config]
                row = _row(path, config.split("-")[0], agents, context)   # sparse-w4a16: a sparse row
                bars[config] = {"tok_s": row["decode"]["tok_s"], "run": run,
                                "source": path}
            elif config == "sparse-w4a16":
                bars[config] = {"tok_s": None, "why": "not measured"}
            else:
                fit = _max_agents(config, context)
                bars[config] = {"tok_s": None, "why": "does not fit" if fit is not None and agents > fit
                                else "not measured"}
        out.append({"label": label, "bars": bars})
    return out


def plot(points: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    width = 0.2
    top = max(b["tok_s"] for p in points for b in p["bars"].values() if b["tok_s"])
    labelled = set()
    for i, p in enumerate(points):
        for j, (config, name, color) in enumerate(CONFIGS):
            b, x = p["bars"][config], i + (j - 1.5) * width
            if b["tok_s"]:
                ax.bar(x, b["tok_s"], width, color=color, label=None if config in labelled else name)
                labelled.add(config)
                ax.text(x, b["tok_s"] + top * 0.01, f"{b['tok_s']:.0f}", ha="center", va="bottom", fontsize=8)
                ax.text(x, top * 0.02, b["run"], ha="center", va="bottom", fontsize=6, rotation=90, color="white")
            else:
                ax.text(x, top * 0.03, b["why"], ha="center", va="bottom", fontsize=6.5, rotation=90, color=color)
    ax.set_xticks(range(len(points)), [f"{p['label']}\nagents x context" for p in points])
    ax.set_ylabel("decode tok/s, all agents together")
    ax.set_ylim(0, top * 1.15)
    ax.set_title("Qwen3.5-27B shape (random weights, bf16 unless marked), one H200: decode throughput", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.text(0.01, 0.01, "benchmarks/plot_headline.py from committed bench agents JSON; bars labelled by H200 run "
             "(benchmarks/results/README.md)", fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "docs", "img", "agents-headline.png"))
    a = p.parse_args(argv)
    pts = data()
    for pt in pts:
        print(pt["label"], {c: (b["tok_s"] and round(b["tok_s"], 1)) or b["why"] for c, b in pt["bars"].items()})
    plot(pts, a.out)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
