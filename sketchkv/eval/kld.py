"""`sketchkv eval kld`: how far each candidate's next-token distribution drifts from dense, read against the dense
noise floor.

* Samples: windows of the held-out token stream (files concatenated package by package behind `# file:` headers,
  as in training), each starting at a file start, cut at every `--lengths` context length and followed by
  `--continuation` forced tokens.
* Every configuration is teacher-forced over exactly the same tokens (`LLM.teacher_force`): the prompt is
  prefilled, then one decode step per continuation token, so sparse decode applies as in generation. The first
  continuation token is forced but not scored (its distribution comes from the prefill, which is dense in every
  configuration): every scored position is a decode step, at context length L+1 ... L+C.
* Reference: dense, every sample run on its own (one sequence in the engine), prefill chunks of
  `max_num_batched_tokens`. Candidates run the same way. Prefix caching is off, so no sample reuses another's KV.
* Dense noise floor: dense again through another, equally valid numeric path (`--floor`):
  - `batch`: the samples of a length teacher-forced together in batches of `--floor-batch` (other batch sizes in
    the decode kernels and matmuls; prefill chunks of one sample share steps with the decodes of others, so some
    decode tokens go through the prefill attention path);
  - `chunk`: prefill in chunks of `--floor-chunk` tokens instead of `max_num_batched_tokens` (another
    accumulation order in the attention and Gated DeltaNet prefill);
  - `batch+chunk` (default): both at once.
* Reported per configuration, overall and per length: mean KL(dense || candidate) in nats/token with its spread
  (per-token std, p95, p99; per-sample std and 95% interval of the mean), top-1 agreement with dense (per-sample std
  and 5th percentile), the NLL of the true continuation, and the ratio of the KL to the floor's.
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from sketchkv.eval import common as C

DEFAULT_LENGTHS = [4096, 16384, 65536, 131072, 262144]


def add_args(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, "kld")
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS,
                   help="context lengths in tokens (clipped so context + continuation fits the model)")
    p.add_argument("--continuation", type=int, default=256, help="scored continuation tokens per sample (>= 256 "
                                                                  "for reported numbers)")
    p.add_argument("--samples", type=int, default=8, help="samples per length")
    p.add_argument("--floor", action="append", choices=["batch", "chunk", "batch+chunk", "none"],
                   help="dense noise-floor path(s) (repeatable; default batch+chunk; 'none' skips the floor)")
    p.add_argument("--floor-batch", type=int, default=8, help="samples per batch on the floor's `batch` path")
    p.add_argument("--floor-chunk", type=int, default=None,
                   help="prefill chunk of the floor's `chunk` path (default: a quarter of max_num_batched_tokens)")
    p.add_argument("--baseline", metavar="NAME",
                   help="a candidate to set the others against on the same tokens: per token, their KL to dense minus "
                        "the baseline's (a paired difference, with its 95%% interval) and their KL from the baseline "
                        "itself, each against the floor (e.g. int4 host rows against bf16 rows)")
    C.add_engine_args(p)


def main(args: argparse.Namespace) -> dict:
    if args.from_json:
        return C.replot(args.from_json, markdown, plot, args.out_dir)
    return run_kld(args.model, args.data, args.lengths, args.continuation, args.samples, args.candidate,
                   args.floor or ["batch+chunk"], args.floor_batch, args.floor_chunk, args.seed,
                   args.out_dir or "eval-results", args.name, C.base_options(args), quiet=args.quiet, baseline=args.baseline)


# ----------------------------------------------------------------------------------------------------------
# Samples
# ----------------------------------------------------------------------------------------------------------
def token_stream(tok, docs) -> tuple[list[int], list[int]]:
    """All documents as one token stream (file by file) and the token index where each file starts."""
    pieces = [C.FILE_HEADER.format(rel=d.rel) + d.text for d in sorted(docs, key=lambda d: (d.package, d.rel))]
    ids, starts = [], []
    for e in tok.encode_batch(pieces, add_special_tokens=False):
        starts.append(len(ids))
        ids.extend(e.ids)
    return ids, starts


def make_samples(ids: list[int], starts: list[int], lengths: list[int], continuation: int, samples: int,
                 seed: int, max_len: int) -> list[dict]:
    """Per length, `samples` windows (prompt of L tokens + continuation + 1) starting at distinct file starts."""
    out = []
    for L in lengths:
        prompt_len = min(L, max_len - continuation - 2)
        if prompt_len < 2:
            from sketchkv.errors import SketchKVError
            raise SketchKVError(f"context length {L}: the model's limit {max_len} leaves no room for a "
                                f"{continuation}-token continuation")
        need = prompt_len + continuation + 1
        stream = ids
        if len(stream) < need:  # too little held-out text: wrap around
            stream = ids * (need // len(ids) + 2)
        ok = [s for s in starts if s + need <= len(stream)] or [0]
        rng = random.Random(f"{seed}-kld-{L}")
        picks = rng.sample(ok, samples) if len(ok) >= samples else [rng.choice(ok) for _ in range(samples)]
        for i, s in enumerate(picks):
            w = stream[s:s + need]
            out.append({"length": L, "prompt_len": prompt_len, "i": i, "start": s,
                        "prompt": w[:prompt_len], "cont": w[prompt_len:]})
    return out


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------
def teacher_force_all(llm, samples: list[dict], batch: int, bar) -> list:
    """Log-prob rows of the scored positions (rows 1.. of each continuation), `batch` samples per call."""
    out = []
    for j in range(0, len(samples), batch):
        group = samples[j:j + batch]
        pre = llm.engine.scheduler.num_preemptions
        rows = llm.teacher_force([s["prompt"] for s in group], [s["cont"] for s in group])
        C.check_no_preemption(llm, pre)
        out += [r[1:] for r in rows]
        bar.update(len(group))
    return out


def compare(ref, cand, targets):
    """-> per-token KL(ref || cand) [n] (float64), top-1 agreement [n] bool, NLL of the targets under cand [n]."""
    import torch
    lp = ref.double()
    lq = cand.double()
    # renormalise in float64: fp32 log-softmax rows sum to 1 only to ~1e-7, which would show as (negative) KL
    lp = lp - lp.logsumexp(-1, keepdim=True)
    lq = lq - lq.logsumexp(-1, keepdim=True)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    top1 = lp.argmax(-1) == lq.argmax(-1)
    nll = -lq.gather(-1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0]
    return kl.numpy(), top1.numpy(), nll.numpy()


def _ci95(per_sample) -> float | None:
    """95% interval of a mean over samples: 1.96 x the samples' std / sqrt(n)."""
    import numpy as np
    n = len(per_sample)
    return float(1.96 * np.std(per_sample, ddof=1) / np.sqrt(n)) if n > 1 else None


def summarize_pairs(diffs: list, directs: list, agree: list) -> dict:
    """Per-sample arrays of a candidate against the baseline on the same tokens -> means over the tokens and 95%
    intervals over the samples: KL to dense minus the baseline's (paired), KL(baseline || candidate), top-1."""
    import numpy as np

    def mean(parts):
        return float(np.concatenate(parts).mean()) if parts else None

    return {"n_samples": len(diffs), "n_tokens": int(sum(x.size for x in diffs)),
            "kl_diff_mean": mean(diffs), "kl_diff_ci95": _ci95([x.mean() for x in diffs]),
            "kl_direct_mean": mean(directs), "kl_direct_ci95": _ci95([x.mean() for x in directs]),
            "top1_vs_baseline": mean([a.astype(float) for a in agree])}


def summarize(kls: list, top1s: list, nlls: list) -> dict:
    import numpy as np
    kl_all = np.concatenate(kls) if kls else np.zeros(0)
    t_all = np.concatenate(top1s) if top1s else np.zeros(0, dtype=bool)
    nll_all = np.concatenate(nlls) if nlls else np.zeros(0)
    kl_s = np.array([k.mean() for k in kls])
    t_s = np.array([t.mean() for t in top1s])
    n = len(kls)
    return {
        "n_samples": n, "n_tokens": int(kl_all.size),
        "kl_mean": float(kl_all.mean()) if kl_all.size else None,
        "kl_std": float(kl_all.std()) if kl_all.size else None,
        "kl_p50": C.quantile(kl_all, 0.5), "kl_p95": C.quantile(kl_all, 0.95), "kl_p99": C.quantile(kl_all, 0.99),
        "kl_max": float(kl_all.max()) if kl_all.size else None,
        "kl_sample_std": float(kl_s.std(ddof=1)) if n > 1 else None,
        "kl_ci95": _ci95(kl_s),
        "top1": float(t_all.mean()) if t_all.size else None,
        "top1_sample_std": float(t_s.std(ddof=1)) if n > 1 else None,
        "top1_sample_p5": C.quantile(t_s, 0.05), "top1_sample_min": float(t_s.min()) if n else None,
        "top1_ci95": _ci95(t_s),
        "nll": float(nll_all.mean()) if nll_all.size else None,
    }


FLOOR_PATHS = {
    "batch": "dense, the samples of each length teacher-forced together in batches of {batch} (reference: one at a "
             "time); prefill chunks {ref_chunk}",
    "chunk": "dense, prefill in chunks of {chunk} tokens (reference: {ref_chunk}); one sample at a time",
    "batch+chunk": "dense, batches of {batch} samples (reference: one at a time) and prefill chunks of {chunk} tokens "
                   "(reference: {ref_chunk})",
}


def run_kld(model: str, data: list[str] | None = None, lengths: list[int] | None = None, continuation: int = 256,
            samples: int = 8, candidates: list[str] | None = None, floors: list[str] | None = None,
            floor_batch: int = 8, floor_chunk: int | None = None, seed: int = 0, out_dir: str = "eval-results",
            name: str = "kld", base: dict | None = None, quiet: bool = False, baseline: str | None = None) -> dict:
    import numpy as np
    import torch
    from tqdm import tqdm

    from sketchkv.config import SchedulerConfig
    t_start = time.time()
    base = dict(base or {})
    model, max_pos = C.resolve_model(model)
    lengths = sorted(set(lengths or DEFAULT_LENGTHS))
    if continuation < 1 or samples < 1:
        from sketchkv.errors import SketchKVError
        raise SketchKVError("--continuation and --samples must be >= 1")
    if continuation < 256:
        C.log(f"note: continuation {continuation} < 256 tokens (issue 7 asks >= 256 for reported numbers)", quiet)
    cands = C.parse_candidates(candidates, max_pos)
    if baseline is not None:
        if baseline not in [c.name for c in cands] or len(cands) < 2:
            from sketchkv.errors import SketchKVError
            raise SketchKVError(f"--baseline {baseline!r} must name one of at least two candidates "
                                f"({', '.join(c.name for c in cands)})")
        cands.sort(key=lambda c: c.name != baseline)   # the baseline runs first: its rows are kept for the others
    floors = [f for f in (floors or ["batch+chunk"]) if f != "none"]
    ref_chunk = int(base.get("max_num_batched_tokens") or SchedulerConfig().max_num_batched_tokens)
    floor_chunk = int(floor_chunk or max(64, ref_chunk // 4))

    tok = C.load_tokenizer(model)
    docs, source = C.load_documents(data or [], model)
    ids, starts = token_stream(tok, docs)
    all_samples = make_samples(ids, starts, lengths, continuation, samples, seed, max_pos)
    need_len = max(s["prompt_len"] for s in all_samples) + continuation + 2
    # sparse=False explicitly: a SKETCHKV_SPARSE in the environment must not turn the reference sparse
    common = dict(base, sparse=False, enable_prefix_caching=False, max_model_len=need_len)
    C.log(f"kld: {len(docs)} held-out files, {len(ids):,} tokens; {len(all_samples)} samples "
          f"({samples} x lengths {lengths}), {continuation} scored tokens each", quiet)

    configs = []  # (name, kind, options, batch, description)
    for f in floors:
        opts = dict(common)
        if "chunk" in f:
            opts["max_num_batched_tokens"] = floor_chunk
        if "batch" in f and int(opts.get("max_num_seqs") or 64) < floor_batch:
            opts["max_num_seqs"] = floor_batch
        desc = FLOOR_PATHS[f].format(batch=floor_batch, chunk=floor_chunk, ref_chunk=ref_chunk)
        configs.append(("floor:" + f, "floor", opts, floor_batch if "batch" in f else 1, desc))
    for c in cands:
        configs.append((c.name, "candidate", {**common, **c.options}, 1, c.note))

    results = {"info": C.run_info(model, base), "kind": "kld", "data": source,
               "settings": {"lengths": lengths, "continuation": continuation, "samples": samples, "seed": seed,
                            "scored_positions": "decode steps only: continuation rows 1..C (row 0 comes from the "
                                                "dense prefill in every configuration)",
                            "reference": f"dense, one sample at a time, prefill chunks of {ref_chunk} tokens, "
                                         "no prefix caching",
                            "max_model_len": need_len, "baseline": baseline},
               "prompt_lens": {str(L): next(s["prompt_len"] for s in all_samples if s["length"] == L)
                               for L in lengths},
               "configs": {}}
    with tempfile.TemporaryDirectory(prefix="sketchkv-kld-") as tmp:
        # 1. dense reference, kept on disk (a [C, vocab] fp32 tensor per sample)
        t0 = time.time()
        llm = C.make_llm(model, common)
        bar = tqdm(total=len(all_samples), desc="kld dense reference", unit="sample", disable=quiet)
        ref_nll = {}
        for k, s in enumerate(all_samples):
            rows = teacher_force_all(llm, [s], 1, bar)[0]
            torch.save(rows.clone(), os.path.join(tmp, f"{k}.pt"))
            ref_nll[k] = float(-rows.gather(-1, torch.tensor(s["cont"][1:])[:, None]).mean())
        bar.close()
        C.release(llm)
        del llm
        results["reference_seconds"] = round(time.time() - t0, 1)
        by_len_nll = {}
        for k, s in enumerate(all_samples):
            by_len_nll.setdefault(s["length"], []).append(ref_nll[k])
        results["reference_nll"] = {str(L): float(np.mean(v)) for L, v in by_len_nll.items()}

        # 2. floor paths and candidates against it
        base_kl = {}   # sample -> the baseline candidate's per-token KL to dense (--baseline)
        for cname, kind, opts, batch, desc in configs:
            t0 = time.time()
            llm = C.make_llm(model, opts)
            bar = tqdm(total=len(all_samples), desc=f"kld {cname}", unit="sample", disable=quiet)
            per_len = {L: ([], [], []) for L in lengths}
            pairs = {L: ([], [], []) for L in lengths}   # against the baseline: KL difference, direct KL, top-1
            is_base, vs_base = cname == baseline, kind == "candidate" and baseline is not None and cname != baseline
            for L in lengths:
                group = [(k, s) for k, s in enumerate(all_samples) if s["length"] == L]
                rows = teacher_force_all(llm, [s for _, s in group], batch, bar)
                for (k, s), r in zip(group, rows):
                    ref = torch.load(os.path.join(tmp, f"{k}.pt"))
                    kl, t1, nll = compare(ref, r, s["cont"][1:])
                    per_len[L][0].append(kl)
                    per_len[L][1].append(t1)
                    per_len[L][2].append(nll)
                    if is_base:   # its rows on disk (a [C, vocab] fp32 tensor per sample), its KLs in memory
                        torch.save(r.clone(), os.path.join(tmp, f"base{k}.pt"))
                        base_kl[k] = kl
                    elif vs_base:
                        direct, agree, _ = compare(torch.load(os.path.join(tmp, f"base{k}.pt")), r, s["cont"][1:])
                        pairs[L][0].append(kl - base_kl[k])
                        pairs[L][1].append(direct)
                        pairs[L][2].append(agree)
            bar.close()
            C.release(llm)
            del llm
            entry = {"kind": kind, "options": {k: v for k, v in opts.items() if k not in common or common[k] != v},
                     "description": desc, "seconds": round(time.time() - t0, 1),
                     "overall": summarize(*[sum((per_len[L][i] for L in lengths), []) for i in range(3)]),
                     "by_length": {str(L): summarize(*per_len[L]) for L in lengths}}
            if vs_base:
                entry["vs_baseline"] = {"overall": summarize_pairs(*[sum((pairs[L][i] for L in lengths), [])
                                                                     for i in range(3)]),
                                        "by_length": {str(L): summarize_pairs(*pairs[L]) for L in lengths}}
            results["configs"][cname] = entry
            o = entry["overall"]
            C.save_partial(results, out_dir, name)
            C.log(f"kld {cname}: KL {o['kl_mean']:.4g} nats/token (p95 {o['kl_p95']:.3g}), top-1 {o['top1']:.4f} "
                  f"[{entry['seconds']}s]", quiet)

    floor_name = next((n for n, e in results["configs"].items() if e["kind"] == "floor"), None)
    results["floor"] = floor_name
    if floor_name:
        fl = results["configs"][floor_name]
        for n, e in results["configs"].items():
            e["overall"]["kl_over_floor"] = _ratio(e["overall"]["kl_mean"], fl["overall"]["kl_mean"])
            for L in e["by_length"]:
                e["by_length"][L]["kl_over_floor"] = _ratio(e["by_length"][L]["kl_mean"],
                                                            fl["by_length"][L]["kl_mean"])
            vb = e.get("vs_baseline")
            for stats, f in ([(vb["overall"], fl["overall"])] + [(vb["by_length"][L], fl["by_length"][L])
                                                                  for L in vb["by_length"]]) if vb else []:
                stats["kl_diff_over_floor"] = _ratio(stats["kl_diff_mean"], f["kl_mean"])
                stats["kl_direct_over_floor"] = _ratio(stats["kl_direct_mean"], f["kl_mean"])
    results["seconds"] = round(time.time() - t_start, 1)
    write_outputs(results, out_dir, name)
    return results


def _ratio(a, b):
    """a / b, or None when the floor is zero to float64 resolution (e.g. deterministic fp32 CPU runs)."""
    return None if a is None or b is None or b < 1e-12 else a / b


# ----------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------
def write_outputs(results: dict, out_dir: str, name: str) -> dict:
    return C.write_outputs(results, out_dir, name, markdown, plot)


def markdown(r: dict, png: str) -> str:
    s = r["settings"]
    lines = C.report_header("KL divergence against dense", r) + [
             f"- {s['samples']} samples per length, {s['continuation']} scored tokens each, seed {s['seed']}; "
             f"scored positions: {s['scored_positions']}",
             f"- reference: {s['reference']}",
             ]
    if r.get("floor"):
        lines.append(f"- **dense noise floor** (`{r['floor']}`): {r['configs'][r['floor']]['description']}")
    for n, e in r["configs"].items():
        if e["kind"] == "floor" and n != r.get("floor"):
            lines.append(f"- other floor path `{n}`: {e['description']}")
    lines += ["", "## Overall", "",
              "| configuration | options | KL mean (nats/token) | ± 95% | KL std | KL p95 | KL p99 | × floor | "
              "top-1 agreement | top-1 sample std | top-1 sample p5 | NLL |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, e in r["configs"].items():
        o = e["overall"]
        opts = ", ".join(f"{k}={v}" for k, v in e["options"].items()) or "–"
        lines.append(f"| {n} | {opts} | {C.fmt(o['kl_mean'], '.4g')} | {C.fmt(o['kl_ci95'], '.2g')} | "
                     f"{C.fmt(o['kl_std'], '.3g')} | {C.fmt(o['kl_p95'], '.3g')} | {C.fmt(o['kl_p99'], '.3g')} | "
                     f"{C.fmt(o.get('kl_over_floor'), '.2f')} | {C.fmt(o['top1'], '.4f')} | "
                     f"{C.fmt(o['top1_sample_std'], '.4f')} | {C.fmt(o['top1_sample_p5'], '.4f')} | "
                     f"{C.fmt(o['nll'], '.4f')} |")
    lines += ["", "## By context length", "",
              "| context | prompt tokens | configuration | KL mean | ± 95% | KL p95 | × floor | top-1 | top-1 p5 | "
              "NLL (dense NLL) |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for L in s["lengths"]:
        for n, e in r["configs"].items():
            b = e["by_length"][str(L)]
            lines.append(f"| {C.fmt_len(L)} | {r['prompt_lens'][str(L)]} | {n} | {C.fmt(b['kl_mean'], '.4g')} | "
                         f"{C.fmt(b['kl_ci95'], '.2g')} | {C.fmt(b['kl_p95'], '.3g')} | "
                         f"{C.fmt(b.get('kl_over_floor'), '.2f')} | {C.fmt(b['top1'], '.4f')} | "
                         f"{C.fmt(b['top1_sample_p5'], '.4f')} | {C.fmt(b['nll'], '.4f')} "
                         f"({C.fmt(r['reference_nll'].get(str(L)), '.4f')}) |")
    fl = r.get("floor")
    if fl:
        lines += ["", "## Against the floor", "",
                  "Issue 7's goal: KL at or below the dense noise floor and top-1 agreement at or above it.", ""]
        f = r["configs"][fl]
        for n, e in r["configs"].items():
            if e["kind"] == "floor":
                continue
            kl_ok = [L for L in s["lengths"] if e["by_length"][str(L)]["kl_mean"] <= f["by_length"][str(L)]["kl_mean"]]
            t1_ok = [L for L in s["lengths"] if e["by_length"][str(L)]["top1"] >= f["by_length"][str(L)]["top1"]]
            o, fo = e["overall"], f["overall"]
            lines.append(f"- `{n}`: KL {C.fmt(o['kl_mean'], '.4g')} vs floor {C.fmt(fo['kl_mean'], '.4g')} "
                         f"({C.fmt(o.get('kl_over_floor'), '.2f')}× floor), at or below it at {len(kl_ok)}/"
                         f"{len(s['lengths'])} lengths; top-1 {C.fmt(o['top1'], '.4f')} vs floor "
                         f"{C.fmt(fo['top1'], '.4f')}, at or above it at {len(t1_ok)}/{len(s['lengths'])} lengths")
    base = s.get("baseline")
    if base:
        lines += ["", f"## Against the baseline `{base}` (same tokens)", "",
                  f"ΔKL: the candidate's KL to dense minus `{base}`'s, token by token (paired; its 95% interval over the "
                  f"samples); KL(`{base}` ‖ candidate): how far the candidate's distributions lie from the baseline's "
                  "themselves. Both read against the floor's KL to dense.", "",
                  "| context | configuration | ΔKL | ± 95% | ΔKL / floor | KL(base ‖ cand) | ± 95% | / floor | "
                  "top-1 vs base |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for L in s["lengths"] + ["all"]:
            for n, e in r["configs"].items():
                if "vs_baseline" not in e:
                    continue
                v = e["vs_baseline"]["overall"] if L == "all" else e["vs_baseline"]["by_length"][str(L)]
                lines.append(f"| {L if L == 'all' else C.fmt_len(L)} | {n} | {C.fmt(v['kl_diff_mean'], '+.3g')} | "
                             f"{C.fmt(v['kl_diff_ci95'], '.2g')} | {C.fmt(v.get('kl_diff_over_floor'), '.2f')} | "
                             f"{C.fmt(v['kl_direct_mean'], '.3g')} | {C.fmt(v['kl_direct_ci95'], '.2g')} | "
                             f"{C.fmt(v.get('kl_direct_over_floor'), '.2f')} | {C.fmt(v['top1_vs_baseline'], '.4f')} |")
    lines += ["", f"![KL divergence and top-1 agreement against dense]({png})", "",
              "KL(dense ‖ candidate) is computed over the full vocabulary at each scored position; top-1 agreement is "
              "argmax(dense) == argmax(candidate). Spread: per-token std / p95 / p99; per-sample std, 5th percentile "
              "and the 95% interval of the mean (1.96 · sample std / √n). Configuration rows run as separate engines; "
              f"total time {r.get('seconds', '–')} s.", ""]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    plt = C.pyplot()
    Ls = r["settings"]["lengths"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    floor = r.get("floor")
    positive = [e["by_length"][str(L)]["kl_mean"] for e in r["configs"].values() for L in Ls
                if (e["by_length"][str(L)]["kl_mean"] or 0) > 0]
    for n, e in r["configs"].items():
        kl = [e["by_length"][str(L)]["kl_mean"] for L in Ls]
        ci = [e["by_length"][str(L)]["kl_ci95"] or 0 for L in Ls]
        t1 = [e["by_length"][str(L)]["top1"] for L in Ls]
        t1ci = [e["by_length"][str(L)]["top1_ci95"] or 0 for L in Ls]
        if e["kind"] == "floor":
            style = dict(color="gray" if n == floor else "silver", ls="--", marker="", lw=2,
                         label=f"dense noise floor ({n[6:]})")
            axes[0].plot(Ls, kl, **style)
            axes[0].fill_between(Ls, [max(a - b, 0) for a, b in zip(kl, ci)], [a + b for a, b in zip(kl, ci)],
                                 color=style["color"], alpha=0.15)
            axes[1].plot(Ls, t1, **style)
        else:
            axes[0].errorbar(Ls, kl, yerr=ci, marker="o", capsize=3, label=n)
            axes[1].errorbar(Ls, t1, yerr=t1ci, marker="o", capsize=3, label=n)
    ax = axes[0]
    n_points = sum(1 for e in r["configs"].values() for _ in Ls)
    if positive and len(positive) == n_points:
        ax.set_yscale("log")
    else:  # some exact zeros (e.g. a configuration identical to dense): linear near zero
        ax.set_yscale("symlog", linthresh=min(positive) / 2 if positive else 1e-6)
    ax.set_ylabel("mean KL(dense ‖ config), nats/token")
    ax.set_title("KL divergence against dense")
    axes[1].set_ylabel("top-1 agreement with dense")
    axes[1].set_title("top-1 agreement")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ls)
        ax.set_xticklabels([C.fmt_len(L) for L in Ls])
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{os.path.basename(r['info']['model'].rstrip('/'))}: {r['settings']['continuation']} scored "
                 f"tokens x {r['settings']['samples']} samples per length ({r['info']['device']})", fontsize=10)
    C.save_figure(fig, path)
