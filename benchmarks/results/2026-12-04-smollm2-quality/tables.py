"""Combine sweep-*.json of this folder into one table per context length (KL and top-1 against the bf16 floor)
and one plot of KL against the fraction of tokens read. Run: python tables.py (writes tables.md, kl-vs-read.png)."""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load():
    """{L: {config: pooled stats}}: every sweep-*.json here; a configuration measured on several samples (other
    seeds, e.g. sweep-8k-seed1.json) is pooled over their tokens (the same number per sample)."""
    parts = {}
    for f in sorted(glob.glob(os.path.join(HERE, "sweep-*.json"))):
        r = json.load(open(f))
        for n, e in r["configs"].items():
            for L, b in e["by_length"].items():
                parts.setdefault(int(L), {}).setdefault(n, []).append({**b, "family": e["family"]})
    out = {}
    for L, d in parts.items():
        for n, bs in d.items():
            w = [b["n_tokens"] for b in bs]
            pool = lambda key: sum(b[key] * x for b, x in zip(bs, w)) / sum(w)   # noqa: E731
            out.setdefault(L, {})[n] = {"kl_mean": pool("kl_mean"), "top1": pool("top1"), "nll": pool("nll"),
                                        "frac_read": pool("frac_read"), "n_samples": sum(b["n_samples"] for b in bs),
                                        "n_tokens": sum(w), "family": bs[0]["family"],
                                        "per_sample_kl": [x for b in bs for x in b["per_sample_kl"]]}
    return out


def main():
    data = load()
    lines = []
    for L in sorted(data):
        d = data[L]
        fl = d.get("floor:bf16")
        fkl = fl["kl_mean"] if fl else None
        lines += [f"### {L // 1024}K context", "",
                  "255 scored tokens per sample; several samples: pooled over their tokens (per-sample KL in the last "
                  "column). Floor = KL(dense fp32 || dense bf16) over the samples the floor was measured on.", "",
                  "| configuration | samples | tokens read | KL (nats/token) | x bf16 floor | top-1 | top-1 - floor's | NLL | "
                  "KL per sample |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        order = sorted(d, key=lambda n: (not n.startswith("floor"), d[n]["family"], d[n]["frac_read"]))
        for n in order:
            b = d[n]
            ratio = f"{b['kl_mean'] / fkl:.2f}" if fkl else "–"
            dt = f"{(b['top1'] - fl['top1']) * 100:+.1f} pt" if fl else "–"
            per = ", ".join(f"{x:.4g}" for x in b["per_sample_kl"])
            lines.append(f"| {n} | {b['n_samples']} | {b['frac_read']:.1%} | {b['kl_mean']:.4g} | {ratio} | "
                         f"{b['top1']:.4f} | {dt} | {b['nll']:.4f} | {per} |")
        lines.append("")
    open(os.path.join(HERE, "tables.md"), "w").write("\n".join(lines))
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    Ls = sorted(data)
    fig, axes = plt.subplots(1, len(Ls), figsize=(5.5 * len(Ls), 4.8), squeeze=False)
    for ax, L in zip(axes[0], Ls):
        fams = {}
        for n, b in data[L].items():
            fams.setdefault(b["family"], []).append((b["frac_read"], b["kl_mean"], n))
        for fam, pts in sorted(fams.items()):
            pts.sort()
            if fam == "floor":
                for x, y, n in pts:
                    if "bf16" in n:   # the fp32 chunk floor (~5e-12) is in the table, off this scale
                        ax.axhline(y, ls="--", color="gray", label="dense bf16 (the floor)")
                        lo = min([y] + [b["kl_mean"] for b in data[L].values() if b["kl_mean"] > 1e-9])
                        ax.set_ylim(bottom=lo / 2)
                continue
            ax.plot([p[0] for p in pts], [max(p[1], 1e-9) for p in pts], marker="o" if len(pts) > 1 else "s",
                    label=fam)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=0))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("fraction of tokens read per decode step")
        ax.set_ylabel("KL(dense fp32 || config), nats/token")
        ax.set_title(f"SmolLM2-135M-Instruct (Q4_1), {L // 1024}K context")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "kl-vs-read.png"), dpi=110)


if __name__ == "__main__":
    main()
