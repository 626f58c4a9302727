"""`python -m sketchkv.eval.sweep`: many sparse-decode configurations against dense on the same samples, each
sample prefilled once per engine (issue 40: what a real model says under sparse decode).

`sketchkv eval kld` builds one engine per configuration and prefills every sample in each; on a 2-core CPU an 8K
prompt of a 135M model takes minutes, so a table of a dozen configurations would spend most of its time in
identical dense prefills. Here the configurations that only change the *selection* share one engine:

* **sparse engine** (paged fp32 K/V, prefix caching on): the dense reference runs first (the runner's dense
  threshold lifted, so every layer takes the dense decode kernel), then every selection configuration replays the
  same teacher-forced continuation over the cached prompt: the per-layer `SparseConfig` is swapped, and a change of
  sketch rank re-sketches every cached key with the basis of that rank (`sketch_keys_ref`, the function the write
  path implements), so each configuration scores exactly the sketches it would have written itself;
* one engine per **host-tier** row format (and the production configuration), one per **floor** path (dense bf16;
  dense fp32 with another prefill chunking) and one for the **prune-at-prefill** baseline (SnapKV-style,
  `sketchkv.eval.prune`): these change the prompt's stored K/V, so each prefills its own copy.

Scored positions are the decode steps of the continuation (row 0 comes from the dense prefill), as in `eval kld`.
Budgets scale with the context: top-k = frac x context for each `--k-fracs`, with fixed sinks and recent window;
the fraction of tokens read is (sinks + k + recent) / mean context. Writes NAME.json (summaries, per-sample
means), NAME_tokens.npz (per-token KL per configuration, for the per-step error estimate), NAME.md and NAME.png
(KL against the fraction read, per context length, with the floors).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

from sketchkv.eval import common as C
from sketchkv.eval.kld import compare, make_samples, summarize, token_stream


# ----------------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    name: str
    group: str                 # sparse | tier | floor-bf16 | floor-chunk | prune
    family: str                # line in the plot
    k: int = 0
    rank: int | None = None
    sparse: dict = dataclasses.field(default_factory=dict)     # SparseConfig fields (sparse group, tier)
    options: dict = dataclasses.field(default_factory=dict)    # engine options (tier, floors)
    layer_k: list[int] | None = None   # per-layer top-k (sparse group; --layer-k), mean = k


def build_configs(L: int, fracs: list[float], ranks: list[int], prod: dict, tier_formats: list[str],
                  prod_rank: int, variants: dict | None = None) -> list[Config]:
    """Per context length L. variants {name: SparseConfig fields}: each selection configuration again with
    those fields (named NAME+variant), e.g. {"d1": {"dense_layers": 1}}."""
    out = _base_configs(L, fracs, ranks, prod, tier_formats, prod_rank)
    for vname, fields in (variants or {}).items():
        out += [dataclasses.replace(c, name=f"{c.name}+{vname}", family=f"{c.family} +{vname}",
                                    sparse={**c.sparse, **fields})
                for c in out if c.group in ("sparse", "tier") and c.family != "production"]
    return out


def layer_k(k: int, weights: list[float], lo: float = 0.25, hi: float = 8.0) -> list[int]:
    """Per-layer top-k with the same total rows as k in every layer, each layer's share ~ sqrt(weight) (weight: its
    missed mass at k; if a layer's error goes as missed mass x k / k_j, sqrt is what minimises the sum), clipped to
    [lo k, hi k]; rounding leftovers go to the heaviest layers."""
    import numpy as np
    w = np.sqrt(np.maximum(np.asarray(weights, dtype=float), 1e-6))
    ks = np.clip(k * len(w) * w / w.sum(), lo * k, hi * k)
    ks = np.floor(ks * (k * len(w) / ks.sum())).astype(int)
    for j in np.argsort(-w)[:k * len(w) - ks.sum()]:
        ks[j] += 1
    return [int(x) for x in ks]


def _base_configs(L: int, fracs: list[float], ranks: list[int], prod: dict, tier_formats: list[str],
                  prod_rank: int) -> list[Config]:
    ks = [max(8, int(round(f * L))) for f in fracs]
    kmid = ks[len(ks) // 2]
    out = [Config("floor:bf16", "floor-bf16", "floor", options={"dtype": "bfloat16"}),
           Config("floor:chunk", "floor-chunk", "floor", options={"max_num_batched_tokens": 512})]
    for k in ks:
        out.append(Config(f"oracle-shared-k{k}", "sparse", "oracle shared", k, None,
                          {"selector": "exact", "shared_selection": True}))
        out.append(Config(f"oracle-kvhead-k{k}", "sparse", "oracle per-KV-head", k, None,
                          {"selector": "exact", "shared_selection": False}))
        for r in ranks:
            out.append(Config(f"sketch{r}-shared-k{k}", "sparse", f"sketch r{r} shared", k, r,
                              {"shared_selection": True}))
            out.append(Config(f"sketch{r}-kvhead-k{k}", "sparse", f"sketch r{r} per-KV-head", k, r,
                              {"shared_selection": False}))
        out.append(Config(f"prune-snapkv-k{k}", "prune", "prune (SnapKV, per KV head)", k))
    for fmt in tier_formats:
        out.append(Config(f"tier-{fmt}-r{prod_rank}-k{kmid}", "tier", f"tier {fmt}", kmid, prod_rank,
                          {"shared_selection": True}, {"sparse_host_tier": True, "sparse_host_format": fmt}))
    if prod:
        p = dict(prod)
        r = int(p.pop("rank", prod_rank))
        frac = float(p.pop("k_frac", fracs[len(fracs) // 2]))
        k = max(8, int(round(frac * L)))
        out.append(Config(f"production-k{k}", "tier", "production", k, r, {"shared_selection": True},
                          {"sparse_host_tier": True, **p}))
    return out


# ----------------------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------------------
def resketch(layer, basis, mean) -> None:
    """Give a SparseAttention layer a basis of another rank: every cached key sketched again with it."""
    from sketchkv.ops.sketch import sketch_keys_ref
    nb, bs, H, D = layer.k_cache.shape
    packed, scale = sketch_keys_ref(layer.k_cache.reshape(-1, H, D), mean, basis)
    layer.basis, layer.mean, layer.rank = basis, mean, basis.shape[-1]
    layer.sketch = packed.view(nb, bs, H, -1).contiguous()
    layer.sketch_scale = scale.view(nb, bs, H).contiguous()


def teacher_force(llm, s):
    """The continuation's log-prob rows of the decode steps (row 0 comes from the prefill) [C - 1, vocab]."""
    rows = llm.teacher_force([s["prompt"]], [s["cont"]])[0]
    return rows[1:]


class Run:
    def __init__(self, args):
        self.args = args
        self.results = {"configs": {}, "lengths": {}}
        self.tokens = {}         # config name -> {sample key: per-token KL}
        self.refs = {}           # sample key -> reference log-prob rows [C, vocab]
        self.miss = {}           # "config|sample" -> per-step, per-layer missed-mass estimates

    def estimates(self, cfg: Config, key: str, est) -> None:
        """Per-step missed-mass estimates [steps, layers] against the per-step KL of the same run."""
        import numpy as np
        kl = self.tokens[cfg.name][key]
        self.miss[f"{cfg.name}|{key}"] = est
        mean = est.mean(1)

        def corr(a, b):
            return float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else None

        def rank(a):
            return np.argsort(np.argsort(a)).astype(float)
        e = self.results["configs"][cfg.name].setdefault("miss_estimate", {})
        e[key] = {"mean": float(mean.mean()), "pearson_kl": corr(mean, kl), "spearman_kl": corr(rank(mean), rank(kl)),
                  "pearson_log_kl": corr(mean, np.log(np.maximum(kl, 1e-12))),
                  "per_layer_mean": [float(x) for x in est.mean(0)],
                  "per_layer_pearson_kl": [corr(est[:, j], kl) for j in range(est.shape[1])]}
        C.log(f"  {cfg.name} {key}: missed-mass estimate {mean.mean():.3f}, corr with per-step KL: Pearson "
              f"{e[key]['pearson_kl']}, Spearman {e[key]['spearman_kl']}")

    def record(self, cfg: Config, L: int, key: str, s, rows, frac_read: float):
        kl, t1, nll = compare(self.refs[key], rows, s["cont"][1:])
        e = self.results["configs"].setdefault(cfg.name, {"group": cfg.group, "family": cfg.family, "k": cfg.k,
                                                          "rank": cfg.rank, "layer_k": cfg.layer_k,
                                                          "sparse": cfg.sparse,
                                                          "options": cfg.options, "by_length": {}, "_raw": {}})
        raw = e["_raw"].setdefault(str(L), [[], [], []])
        raw[0].append(kl), raw[1].append(t1), raw[2].append(nll)
        e["by_length"][str(L)] = {**summarize(*raw), "frac_read": frac_read,
                                  "per_sample_kl": [float(x.mean()) for x in raw[0]]}
        self.tokens.setdefault(cfg.name, {})[key] = kl
        C.log(f"  {cfg.name:28s} L={L} {key}: KL {kl.mean():.4g} top-1 {t1.mean():.4f} (read {frac_read:.3%})")


def _recording(layer, out: list):
    """layer.pick_grouped that also appends the step's missed-mass estimate (batch of one) to `out`."""
    orig = type(layer).pick_grouped

    def pick_grouped(*a, **kw):
        picks = orig(layer, *a, **kw)
        if layer.last_miss_estimate is not None:
            out.append(float(layer.last_miss_estimate[0]))
        return picks
    return pick_grouped


def frac_read(cfg: Config, s, sinks: int, recent: int, cont: int, n_layers: int) -> float:
    """Rows read per step over the rows a dense step reads, at the continuation's mean context (the first
    dense_layers layers read everything)."""
    ctx = s["prompt_len"] + cont / 2
    if cfg.group.startswith("floor"):
        return 1.0
    if cfg.group == "prune":
        return min(1.0, (sinks + cfg.k + recent + cont / 2) / ctx)
    f = min(1.0, (sinks + cfg.k + recent) / ctx)
    d = min(int(cfg.sparse.get("dense_layers", 0)), n_layers)
    return (d + (n_layers - d) * f) / n_layers


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="+", help="held-out files / directories (.py files under directories)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--basis", action="append", required=True, metavar="RANK=PATH",
                    help="key basis file per rank (repeatable)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--samples", type=int, nargs="+", default=[2], help="samples per length (one value or one each)")
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=16)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--k-fracs", type=float, nargs="+", default=[1 / 128, 1 / 64, 1 / 32],
                    help="top-k as fractions of the context length")
    ap.add_argument("--tier-formats", nargs="*", default=["int4", "k8v4", "int8"])
    ap.add_argument("--tier-rank", type=int, default=32)
    ap.add_argument("--production", default="", help="KEY=VALUE,... of the production configuration (engine "
                                                       "options over the host tier, plus rank= and k_frac=); empty: none")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="every selection / tier configuration again with these SparseConfig fields, e.g. "
                         "d1:dense_layers=1 (repeatable)")
    ap.add_argument("--miss-estimate", action="store_true",
                    help="selection configurations of the sparse engine also record the per-step, per-layer estimate "
                         "of the candidates' attention mass their picks miss (sparse miss_estimate) and its "
                         "correlation with the per-step KL (issue 40 part 5)")
    ap.add_argument("--layer-k", metavar="FILE.json:CONFIG",
                    help="adaptive k per layer at equal rows: every selection configuration again (NAME+lk) with each "
                         "layer's top-k set from CONFIG's per-layer missed-mass estimate in an earlier sweep's "
                         "FILE.json (run with --miss-estimate on other samples; see layer_k)")
    ap.add_argument("--only", default=".*", help="regex over configuration names to run")
    ap.add_argument("--skip", default="^$", help="regex over configuration names to skip")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="eval-results")
    ap.add_argument("--name", default="sweep")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared CPU: OpenMP spin-waits on an oversubscribed machine made a 2-thread run several times slower)")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    torch.set_num_threads(args.threads)
    from sketchkv.eval.prune import install_prune
    from sketchkv.kv.basis import KeyBasis
    from sketchkv.llm import LLM
    weights = None
    if args.layer_k:   # per-layer estimates, averaged over that run's samples and lengths
        f, name = args.layer_k.rsplit(":", 1)
        est = json.load(open(f))["configs"][name]["miss_estimate"].values()
        weights = np.mean([e["per_layer_mean"] for e in est], axis=0).tolist()

    bases = {int(r): p for r, p in (b.split("=", 1) for b in args.basis)}
    loaded = {r: KeyBasis.load(p) for r, p in bases.items()}
    ranks = sorted(bases)
    prod = {}
    for item in filter(None, args.production.split(",")):   # rank= / k_frac= are not engine options
        k, v = item.split("=", 1)
        prod.update({k: v} if k in ("rank", "k_frac") else C.parse_options(item))
    variants = {}
    for v in args.variant:
        vname, opts = v.split(":", 1)
        variants[vname] = {k[len("sparse_"):] if k.startswith("sparse_") else k: x
                           for k, x in C.parse_options(opts).items()}
    from sketchkv.models.loader import load_config
    n_layers = len(load_config(args.model).full_attention_layers)
    samples_per = args.samples * len(args.lengths) if len(args.samples) == 1 else args.samples
    tok = C.load_tokenizer(args.model)
    docs = C.read_documents(args.data)
    ids, starts = token_stream(tok, docs)
    run = Run(args)
    t_start = time.time()
    run.results.update({"info": C.run_info(args.model, {"device": "cpu", "dtype": "float32"}),
                        "data": {"paths": [os.path.abspath(p) for p in args.data], "files_read": len(docs),
                                 "tokens": len(ids)},
                        "settings": {k: v for k, v in vars(args).items()}, "bases": bases})
    only, skip = re.compile(args.only), re.compile(args.skip)
    base = dict(device="cpu", dtype="float32", max_num_seqs=1, max_num_batched_tokens=8192)
    sparse_common = dict(sparse_sink_tokens=args.sinks, sparse_recent_tokens=args.recent)
    out_json = os.path.join(args.out_dir, args.name + ".json")

    def save(partial=True):
        res = {**run.results, "partial": partial, "seconds": round(time.time() - t_start, 1)}
        res["configs"] = {n: {k: v for k, v in e.items() if k != "_raw"} for n, e in run.results["configs"].items()}
        C.write_json(out_json, res)
        np.savez_compressed(os.path.join(args.out_dir, args.name + "_tokens.npz"),
                            **{f"{n}|{k}": v for n, d in run.tokens.items() for k, v in d.items()},
                            **{f"miss|{k}": v for k, v in run.miss.items()})

    for L, n_s in zip(args.lengths, samples_per):
        samples = make_samples(ids, starts, [L], args.continuation, n_s, args.seed, 8192)
        need = max(s["prompt_len"] for s in samples) + args.continuation + 2
        cfgs = build_configs(L, args.k_fracs, ranks, prod, args.tier_formats, args.tier_rank, variants)
        if weights is not None:
            cfgs += [dataclasses.replace(c, name=c.name + "+lk", family=c.family + " +lk",
                                         layer_k=layer_k(c.k, weights)) for c in cfgs if c.group == "sparse"]
        cfgs = [c for c in cfgs if only.search(c.name) and not skip.search(c.name)]
        run.results["lengths"][str(L)] = {"prompt_len": samples[0]["prompt_len"], "samples": n_s,
                                          "starts": [s["start"] for s in samples]}
        C.log(f"L={L}: {n_s} samples, {len(cfgs)} configurations")
        # 1. the sparse engine: reference + every selection configuration over one prefill per sample
        sp_cfgs = [c for c in cfgs if c.group == "sparse"]
        rmax = max(ranks)
        llm = LLM(args.model, **base, max_model_len=need, enable_prefix_caching=True, sparse=True,
                  sparse_basis=bases[rmax], sparse_dense_threshold=0, sparse_top_k=64, **sparse_common)
        runner = llm.engine.runner
        layers = runner.sparse_layers
        sp0 = layers[0].cfg
        for i, s in enumerate(samples):
            key = f"{L}-{i}"
            t0 = time.time()
            runner.dense_threshold = 1 << 30
            run.refs[key] = teacher_force(llm, s).clone()
            C.log(f"L={L} sample {i}: dense reference {time.time() - t0:.0f}s")
            runner.dense_threshold = 0
            cur_rank = None
            for c in sp_cfgs:
                r = c.rank or rmax
                if r != cur_rank:
                    for j, m in enumerate(layers):
                        resketch(m, loaded[r].bases[j].contiguous(), loaded[r].means[j].contiguous())
                    cur_rank = r
                cfg = dataclasses.replace(sp0, top_k=c.k, miss_estimate=args.miss_estimate, **c.sparse)
                est = [[] for _ in layers]
                for j, m in enumerate(layers):
                    m.cfg = dataclasses.replace(cfg, top_k=c.layer_k[j]) if c.layer_k else cfg
                    m.last_miss_estimate = None
                    if args.miss_estimate:
                        m.pick_grouped = _recording(m, est[j])
                run.record(c, L, key, s, teacher_force(llm, s), frac_read(c, s, args.sinks, args.recent,
                                                                           args.continuation, n_layers))
                if args.miss_estimate and all(len(e) == len(run.tokens[c.name][key]) for e in est) and est[0]:
                    run.estimates(c, key, np.array(est).T)   # [steps, layers]
                for m in layers:
                    m.__dict__.pop("pick_grouped", None)
            save()
        C.release(llm)
        del llm
        # 2. engines that store the prompt differently: one per configuration, each prefilling every sample
        for c in cfgs:
            if c.group == "sparse":
                continue
            t0 = time.time()
            if c.group == "floor-bf16" or c.group == "floor-chunk":
                llm = LLM(args.model, **{**base, **c.options}, max_model_len=need, enable_prefix_caching=False)
            elif c.group == "prune":
                llm = LLM(args.model, **base, max_model_len=need, enable_prefix_caching=False, enforce_eager=True)
                pl = install_prune(llm, args.sinks, c.k, args.recent, pool=7, shared=False)
            else:   # tier
                llm = LLM(args.model, **base, max_model_len=need, enable_prefix_caching=False, sparse=True,
                          sparse_basis=bases[c.rank], sparse_top_k=c.k, sparse_dense_threshold=0,
                          sparse_host_budget_gb=2.0, **sparse_common,
                          **{k: v for k, v in c.options.items()},
                          **{"sparse_" + k: v for k, v in c.sparse.items()})
            for i, s in enumerate(samples):
                key = f"{L}-{i}"
                if c.group == "prune":
                    for m in pl:
                        m.arm(s["prompt_len"], 32)
                run.record(c, L, key, s, teacher_force(llm, s), frac_read(c, s, args.sinks, args.recent,
                                                                           args.continuation, n_layers))
            C.release(llm)
            del llm
            C.log(f"L={L} {c.name}: {time.time() - t0:.0f}s")
            save()
    save(partial=False)
    res = json.load(open(out_json))
    C.write_text(os.path.join(args.out_dir, args.name + ".md"), markdown(res))
    try:
        plot(res, os.path.join(args.out_dir, args.name + ".png"))
    except Exception as e:  # noqa: BLE001
        C.log(f"no plot ({type(e).__name__}: {e})")
    return res


# ----------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    lines = [f"# Sparse decode against dense: configuration sweep ({os.path.basename(r['info']['model'])})", "",
             f"- command: `{r['info']['command']}`", f"- date {r['info']['date']}; device {r['info']['device']}; "
             f"torch {r['info']['torch']}", f"- data: {r['data']['files_read']} files, {r['data']['tokens']:,} "
             f"tokens from {', '.join(r['data']['paths'])}", ""]
    for L, info in r["lengths"].items():
        lines += [f"## {C.fmt_len(int(L))} context ({info['prompt_len']} prompt tokens, {info['samples']} samples, "
                  f"{r['settings']['continuation'] - 1} scored tokens each)", "",
                  "| configuration | read | KL (nats/token) | ± 95% | KL p99 | top-1 | NLL |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for n, e in r["configs"].items():
            b = e["by_length"].get(L)
            if b is None:
                continue
            lines.append(f"| {n} | {b['frac_read']:.2%} | {C.fmt(b['kl_mean'], '.4g')} | {C.fmt(b['kl_ci95'], '.2g')} | "
                         f"{C.fmt(b['kl_p99'], '.3g')} | {C.fmt(b['top1'], '.4f')} | {C.fmt(b['nll'], '.4f')} |")
        lines.append("")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    plt = C.pyplot()
    Ls = list(r["lengths"])
    fig, axes = plt.subplots(1, len(Ls), figsize=(5.2 * len(Ls), 4.6), squeeze=False)
    for ax, L in zip(axes[0], Ls):
        fams = {}
        for n, e in r["configs"].items():
            b = e["by_length"].get(L)
            if b is None:
                continue
            fams.setdefault(e["family"], []).append((b["frac_read"], b["kl_mean"], b["kl_ci95"] or 0, n))
        for fam, pts in fams.items():
            pts.sort()
            if fam == "floor":
                for x, y, ci, n in pts:
                    ax.axhline(y, ls="--", color="gray" if "bf16" in n else "silver",
                               label=f"{n} (dense)")
                continue
            xs, ys, es = [p[0] for p in pts], [max(p[1], 1e-9) for p in pts], [p[2] for p in pts]
            ax.errorbar(xs, ys, yerr=es, marker="o" if len(pts) > 1 else "s", capsize=3, label=fam)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("fraction of tokens read per step")
        ax.set_ylabel("KL(dense ‖ config), nats/token")
        ax.set_title(f"{C.fmt_len(int(L))} context")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    C.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
