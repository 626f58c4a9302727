"""`sketchkv bench step`: one decode step of N agents x L tokens, kernel by kernel, against its bytes floor.

The yardstick for making the decode step cheaper (issue 41): every change to the step is judged by the same
command. The engine and the contexts are built as `bench agents` builds them (its helpers: --fill random
writes random caches for all but the last --tail tokens of each agent, then prefills those), then

    always     --warmup-steps steps, then --steps timed steps (CUDA graphs on a GPU; each step between
               device syncs): the mean step time, and the bytes the step must move at the HBM / PCIe
               bandwidths measured in the same run (sketchkv/bench/floor.py): floor ms and floor / step
    --profile  on a GPU: --steps more steps under torch.profiler (sketchkv/bench/breakdown.py:profile_steps);
               the median step (by its kernels' span) as a timeline: every kernel's start, duration, the GPU's
               idle time before it (the gap) and its kind; totals (kernels, kernel time, GPU busy time, gaps,
               host time around the kernels), the graph replay's own part (its kernels found by their
               cudaGraphLaunch: the gaps inside it, apart from the eager work and launch around it), time and
               count per kind, the 20 largest gaps with the kernels around them; plus the mean over the
               profiled steps by kind and by kernel name (as `bench agents --breakdown`). A PNG draws the
               step's kernels along time, colored by kind.
               On a CPU there are no kernels to trace: timed regions by layer group over eager steps
               (breakdown.measure) instead, and the report says so.

Output: NAME.json (everything, with the device, date and command), NAME.md, NAME.png (with --profile on a GPU);
a short table on stdout last.

    sketchkv bench step --device cpu --agents 1 --context 1K --steps 4 --profile       # reference model, CPU
    sketchkv bench step --model random:qwen3.5-27b --agents 8 --context 250K --fill random \\
        --sparse-host-format int4 --profile                                            # one H100 / H200
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import statistics
import sys
from types import SimpleNamespace

from sketchkv.bench import agents as A
from sketchkv.errors import SketchKVError
from sketchkv.eval import common as C


def add_args(p: argparse.ArgumentParser) -> None:
    from sketchkv.config import default_model
    p.add_argument("--model", default=default_model(),
                   help="model directory, or random:PRESET (random:qwen3.5-27b: the 27B shape, random weights; "
                        "random:qwen3.5-27b-w4a16: its projections int4)")
    p.add_argument("--agents", type=int, default=1, help="agents decoding together (the batch of every step)")
    p.add_argument("--context", type=A.parse_tokens, default=1024,
                   help="tokens of context per agent (K = 1024: 250K = 256000)")
    p.add_argument("--config", choices=("sparse", "dense"), default="sparse",
                   help="sparse (+ host tier, as bench agents' sparse rows) or dense (paged KV on the GPU)")
    p.add_argument("--steps", type=int, default=8,
                   help="timed steps (mean step time); with --profile, as many profiled steps after them")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed decode steps first (graph replays warm)")
    p.add_argument("--profile", action="store_true",
                   help="GPU: the step's kernel timeline under torch.profiler (+ PNG); CPU: timed regions")
    p.add_argument("--fill", choices=("real", "random"), default="real",
                   help="real: prefill every prompt; random: write random caches for all but the last --tail "
                        "tokens of each agent, prefill those (as bench agents --fill random)")
    p.add_argument("--tail", type=int, default=1024, help="--fill random: tokens per agent prefilled for real")
    p.add_argument("--text", nargs="*", default=None,
                   help="prompt text files/dirs (default: the model's held-out files, else its calibration/ "
                        "directory; random token ids for random:* models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hbm-gib", type=float, default=None,
                   help="size of the bandwidth copy (default 4 GiB on a GPU, 0.25 on a CPU)")
    p.add_argument("--out-dir", default=None,
                   help="where the .json / .md / .png go (default: a folder of their own, benchmarks/results/NAME/, "
                        "as every published result has)")
    p.add_argument("--name", default=None,
                   help="output file stem (default: step-MODEL-CONFIG-NxL-DATE, e.g. step-qwen3.5-27b-sparse-8x250K-"
                        "2026-12-05)")
    p.add_argument("--quiet", action="store_true")
    A.add_reference_accepted_length(p)
    A.add_engine_args(p)


def default_name(args) -> str:
    model = args.model[len("random:"):] if args.model.startswith("random:") else \
        os.path.splitext(os.path.basename(args.model.rstrip("/")))[0]
    return (f"step-{model}-{args.config}-{args.agents}x{C.fmt_len(args.context)}-"
            f"{datetime.date.today().isoformat()}")


def main(args: argparse.Namespace) -> dict:
    if args.agents < 1 or args.steps < 1 or args.warmup_steps < 0:
        raise SketchKVError("--agents and --steps must be >= 1, --warmup-steps >= 0")
    r = run(args)
    name = args.name or default_name(args)
    paths = write(r, args.out_dir or os.path.join("benchmarks", "results", name), name)
    C.log(f"wrote {', '.join(paths.values())}", args.quiet)
    print(table(r))
    return r


def run(args) -> dict:
    from sketchkv.bench import breakdown as BD
    from sketchkv.bench import floor as F
    from sketchkv.config import build_config, resolved_host_residual_keys
    from sketchkv.engine.llm_engine import resolve_device, resolve_dtype
    from sketchkv.errors import CapacityError
    from sketchkv.llm import LLM
    from sketchkv.sampling_params import SamplingParams
    log = lambda m: C.log(m, args.quiet)  # noqa: E731
    base = A.engine_base(args)
    cfg0 = build_config(model=args.model, **base)
    dev = resolve_device(cfg0.device)
    dtype = resolve_dtype(cfg0.dtype, dev)
    sp = cfg0.sparse
    n, L, bs = args.agents, args.context, cfg0.cache.block_size
    shape = F.shape_of(args.model, dtype, bs, sp.basis)
    mcfg = A.model_config(args.model)
    filled = A.fill_tokens(args, L, bs)
    chunk = cfg0.scheduler.max_num_batched_tokens
    # the tokens each agent generates: warm-up + timed + (profiler's warm step + profiled steps), as bench agents
    steps = SimpleNamespace(warmup_steps=args.warmup_steps, decode_tokens=args.steps, breakdown=args.profile,
                            breakdown_steps=args.steps + 1, num_speculative_tokens=base.get("num_speculative_tokens"))
    max_tokens = A.turn1_max_tokens(steps, n, L - filled, chunk)
    max_len = L + max_tokens + bs
    if max_len > mcfg.max_position_embeddings:
        raise SketchKVError(f"{C.fmt_len(L)} tokens + {max_tokens} generated exceed the model's "
                            f"{mcfg.max_position_embeddings} positions")
    gib = args.hbm_gib if args.hbm_gib is not None else (4.0 if dev.type == "cuda" else 0.25)
    bw = {"hbm": F.hbm_bandwidth(dev, gib), "pcie": F.pcie_bandwidth(dev, min(gib, 1.0))}
    log(f"bandwidth: HBM copy {bw['hbm'] / 1e9:.1f} GB/s" + (f", pinned H2D {bw['pcie'] / 1e9:.1f} GB/s"
                                                              if bw["pcie"] else " (CPU: host tier = main memory)"))
    info = C.run_info(args.model, base)
    if "step" in sys.argv:
        info["command"] = "sketchkv bench step " + " ".join(
            shlex.quote(a) for a in sys.argv[sys.argv.index("step") + 1:])
    stream, source = A.token_stream(args.model, args.text, L)
    log(f"{args.config}: building the engine for {n} agents x {max_len} tokens")
    llm = LLM(args.model, **A.engine_options(args, base, args.config, n, max_len, shape))
    eng, runner = llm.engine, llm.engine.runner
    try:
        need = n * -(-(L + max_tokens) // bs)
        if need > eng.blocks.num_blocks - 1:
            raise CapacityError(f"{n} agents need {need} KV blocks, the engine has {eng.blocks.num_blocks - 1}")
        prompts, _ = A.agent_prompts(stream, n, L, SimpleNamespace(seed=args.seed, followup_tokens=0),
                                     eng.model_config.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        log(f"prefill: {n} agents x {L} tokens ({filled} per agent from random caches)" if filled else
            f"prefill: {n} agents x {L} tokens")
        seqs, prefill = A.prefill_agents(eng, prompts, filled, params, args.fill, args.seed)
        if len(eng.scheduler.running) != n or eng.scheduler.waiting:
            raise RuntimeError("not every agent is decoding")
        for _ in range(args.warmup_steps):
            eng.step()
        # ---- timed steps
        tier0 = llm.tier_stats()
        runner.replay_events = [] if runner.graphs else None
        times, tokens, ctx_mean = A.time_steps(eng, seqs, args.steps)
        replays = [a.elapsed_time(b) for a, b in runner.replay_events or ()]   # ms (synced by time_steps)
        runner.replay_events = None
        tier, pcie = A.tier_window(runner, tier0, llm.tier_stats(), len(times))
        step_s = statistics.fmean(times)
        decode = {"steps": len(times), "step_ms_mean": 1e3 * step_s, "step_ms_p50": 1e3 * statistics.median(times),
                  "step_ms_min": 1e3 * min(times), "step_ms_max": 1e3 * max(times), "tok_s": tokens / sum(times),
                  "context_mean": ctx_mean, "graphs": bool(runner.graphs)}
        if len(replays) == len(times):   # one decode graph replay per timed step: the rest is outside it
            decode["graph_replay_ms_mean"] = statistics.fmean(replays)
            decode["outside_graph_ms_mean"] = decode["step_ms_mean"] - decode["graph_replay_ms_mean"]
        if steps.num_speculative_tokens:   # every step verifies every agent's drafts
            ref = args.reference_accepted_length
            decode["speculative"] = {"num_speculative_tokens": steps.num_speculative_tokens,
                                     "mean_accepted_length": tokens / (n * len(times)),   # tokens kept per verification
                                     "reference_accepted_length": ref,
                                     "projected_tok_s": n * ref / step_s if ref else None}
        b, floor = A.step_floor(shape, sp, args.config, n, ctx_mean, pcie, tier0 is not None, bw, step_s)
        log(f"step {decode['step_ms_mean']:.2f} ms ({decode['tok_s']:.1f} tok/s), floor {floor['ms']:.2f} ms "
            f"({floor['fraction']:.0%})" + ("; " + _spec_note(decode) if "speculative" in decode else ""))
        # ---- profile
        profile = None
        if args.profile and dev.type == "cuda":
            log(f"profiling {args.steps} steps (torch.profiler)")
            p = BD.profile_steps(eng, args.steps)
            per = [BD.step_timeline(s, w, launches=p["launches"]) for s, w in zip(p["per_step"], p["windows"])]
            if not per:
                raise RuntimeError("no step was profiled (no agent left running)")
            pick = sorted(range(len(per)), key=lambda i: per[i]["totals"]["span_ms"])[len(per) // 2]
            profile = {"method": "torch.profiler over CUDA-graph decode steps (each step between device syncs)"
                       if runner.graphs else "torch.profiler over eager decode steps (no CUDA graphs)",
                       "steps": p["steps"], "step": pick, "timeline": per[pick], "step_ms_mean": decode["step_ms_mean"],
                       "attention_layers": BD.attention_layers(per[pick]["kernels"]),
                       "per_step": [t["totals"] for t in per], "mean": BD.kernel_summary(p["spans"], p["steps"])}
        elif args.profile:
            log(f"no CUDA device: timed regions over {args.steps} eager steps instead of a kernel timeline")
            profile = {**BD.measure(eng, args.steps),
                       "note": "no CUDA device: no kernel timeline; timed regions by layer group over eager steps "
                               "(sketchkv/bench/breakdown.py:measure)"}
    finally:
        for rid in list(eng.requests):
            eng.abort(rid)
        C.release(llm)
    return {"info": info, "model": args.model, "config": args.config, "agents": n, "context": L,
            "shape": shape.to_dict(), "bandwidth": bw, "text": source,
            "sparse": {"top_k": sp.top_k, "sink_tokens": sp.sink_tokens, "recent_tokens": sp.recent_tokens,
                       "host_format": sp.host_format, "hot_fraction": sp.hot_fraction,
                       "head_combine": sp.head_combine, "residual_keys": resolved_host_residual_keys(
                           dataclasses.replace(sp, sparse=True, host_tier=True),
                           sketch_selector=not mcfg.indexer_n_heads)} if args.config == "sparse" else None,
            "prefill": prefill, "decode": decode, "tier": tier, "bytes_per_step": b, "floor": floor,
            "profile": profile}


# ----------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------
def write(r: dict, out_dir: str, name: str) -> dict:
    """NAME.json first (the numbers survive a plotting failure), NAME.png when there is a timeline, NAME.md."""
    base = os.path.join(out_dir, name)
    paths = {"json": base + ".json", "md": base + ".md"}
    tl = (r["profile"] or {}).get("timeline")
    if tl and tl["kernels"]:
        paths["png"] = base + ".png"
    r["outputs"] = paths
    C.write_json(paths["json"], r)
    if "png" in paths:
        try:
            plot(r, paths["png"])
        except Exception as e:  # e.g. no matplotlib here: the JSON has every kernel
            C.log(f"no plot written ({type(e).__name__}: {e})")
            del paths["png"]
    C.write_text(paths["md"], markdown(r, os.path.basename(paths.get("png", ""))))
    return paths


def _title(r: dict) -> str:
    return f"{os.path.basename(r['model'].rstrip('/'))}, {r['config']}, {r['agents']} x {C.fmt_len(r['context'])}"


def _spec_note(d: dict) -> str:
    """The log / table note of a speculative step: its measured accepted length, the projected tok/s."""
    sp = d["speculative"]
    note = f"MTP-{sp['num_speculative_tokens']}: accepted length {sp['mean_accepted_length']:.2f} (measured)"
    if sp["projected_tok_s"]:
        note += f", {sp['projected_tok_s']:.1f} tok/s at accepted length {sp['reference_accepted_length']:.2f}"
    return note


def markdown(r: dict, png: str = "") -> str:
    info, d, f, b, bw = r["info"], r["decode"], r["floor"], r["bytes_per_step"], r["bandwidth"]
    L = [f"# Decode step: {_title(r)}", "",
         f"- command: `{info['command']}`",
         f"- date {info['date']}; device {info['device']}; torch {info['torch']}",
         f"- measured in the run: HBM copy {bw['hbm'] / 1e9:.1f} GB/s (read + write)" +
         (f", pinned host-to-device {bw['pcie'] / 1e9:.1f} GB/s" if bw.get("pcie") else ""),
         f"- prefill: {r['prefill']['mode']}" + (f" ({r['prefill']['filled_tokens_per_agent']} tokens per agent from "
                                                  "random caches)" if r["prefill"]["filled_tokens_per_agent"] else "")
         + f"; prompts: {r['text']}"]
    if r["sparse"]:
        s = r["sparse"]
        L.append(f"- sparse: top-k {s['top_k']} + {s['sink_tokens']} sinks + {s['recent_tokens']} recent, host rows "
                 f"{A.host_rows(s['host_format'], s.get('residual_keys', False))}, {s['head_combine']} head combine")
    L += ["", "## Step", "",
          f"{d['steps']} timed {'CUDA-graph' if d['graphs'] else 'eager'} steps, each between device syncs. Floor = "
          "bytes the step must move / HBM bandwidth + PCIe misses / PCIe bandwidth (`sketchkv/bench/floor.py`); "
          "fraction = floor / step.", "",
          "| ms / step (mean) | p50 | min | max | tok/s | floor ms | floor fraction | HBM GB / step (weights / GDN / "
          "K/V rows / sketch) | PCIe MB / step | hit rate |", "|" + "---|" * 10,
          f"| {d['step_ms_mean']:.3f} | {d['step_ms_p50']:.3f} | {d['step_ms_min']:.3f} | {d['step_ms_max']:.3f} | "
          f"{d['tok_s']:.1f} | {f['ms']:.3f} | {f['fraction']:.1%} | {b['hbm'] / 1e9:.3g} ({A._gb(b['weights'])} / "
          f"{A._gb(b['gdn_state'])} / {A._gb(b['kv'])} / {A._gb(b['sketch'])}) | {b['pcie'] / 1e6:.3g} | "
          f"{'–' if r['tier'] is None else format(r['tier']['hit_rate'], '.3f')} |"]
    if "graph_replay_ms_mean" in d:
        L += ["", f"The timed steps' CUDA-graph replays (CUDA events around each, no profiler): "
              f"{d['graph_replay_ms_mean']:.3f} ms; outside them {d['outside_graph_ms_mean']:.3f} ms per step (the "
              "inputs' copies, the host's launch, the lm_head GEMM and sampling after the graph, the host's step)."]
    if d.get("speculative"):
        L += ["", "Speculative verification steps (each agent's last token + its drafts, every step): "
              + _spec_note(d) + ". A random-weight model's drafts are rejected: its measured length is ~1; the "
              "projection (--reference-accepted-length) is agents x that length / the measured step time."]
    p = r["profile"]
    if p and "timeline" in p:
        L += _timeline_md(p, png)
    elif p:
        L += ["", "## Where the time goes (timed regions)", "", f"{p['note']}. {p['method']}, {p['steps']} steps; "
              "self times in ms per step (eager steps are slower than the timed steps above: compare fractions).", "",
              "| " + " | ".join(p["ms"]) + " | sum |", "|" + "---|" * (len(p["ms"]) + 1),
              "| " + " | ".join(f"{v:.3f}" for v in p["ms"].values()) + f" | {p['total_ms']:.3f} |"]
    return "\n".join(L) + "\n"


def _timeline_md(p: dict, png: str) -> list[str]:
    tl, t = p["timeline"], p["timeline"]["totals"]
    busy = max(t["busy_ms"], 1e-9)
    L = ["", "## One step, kernel by kernel", "",
         f"{p['method']}: step {p['step']} of {p['steps']} profiled (the median by its kernels' span); every kernel "
         "of it is in the JSON (`profile.timeline.kernels`: start, duration, gap before it, kind). Gap = the GPU's "
         "idle time before a kernel (no kernel of any stream running); span = first kernel start to last kernel end "
         "= busy + gaps; host = the step's wall time under the profiler (lead: host work before its first kernel, "
         "tail: after its last).", "",
         "| kernels | kernel sum ms | GPU busy ms | gaps ms (count) | span ms | host ms | lead ms | tail ms | "
         "host in graph launch ms | streams | busiest stream: kernels, busy ms, gaps ms |", "|" + "---|" * 11,
         f"| {t['kernels']} | {t['kernel_ms']:.3f} | {t['busy_ms']:.3f} | {t['gap_ms']:.3f} ({t['gaps']}) | "
         f"{t['span_ms']:.3f} | {t.get('host_ms', float('nan')):.3f} | {t.get('lead_ms', float('nan')):.3f} | "
         f"{t.get('tail_ms', float('nan')):.3f} | {t.get('launch_ms', float('nan')):.3f} | {t['streams']} | "
         f"{t['main_stream']['kernels']}, "
         f"{t['main_stream']['busy_ms']:.3f}, {t['main_stream']['gap_ms']:.3f} |", "",
         *_graph_md(p), *_attention_layers_md(p.get("attention_layers")),
         "By kind (this step; gaps before = idle time before that kind's kernels):", "",
         "| kind | ms | count | share of kernel time | gaps before ms |", "|---|---|---|---|---|"]
    gk = tl["gap_ms_before_kind"]
    total = max(t["kernel_ms"], 1e-9)
    for k, v in tl["by_kind"].items():
        L.append(f"| {k} | {v['ms']:.3f} | {v['count']} | {v['ms'] / total:.1%} | {gk.get(k, 0.0):.3f} |")
    for key, what in (("top_graph_gaps", "inside the graph"), ("top_gaps", "anywhere in the step")):
        if not tl.get(key):
            continue
        L += ["", f"The {len(tl[key])} largest gaps {what}:", "",
              "| gap us | at us | kernel before (kind, us) | kernel after (kind, us) |", "|---|---|---|---|"]
        for g in tl[key]:
            be, af = g["before"], g["after"]
            L.append(f"| {g['gap_us']:.1f} | {g['at_us']:.1f} | `{be['name'][:60]}` ({be['kind']}, {be['us']:.1f}) | "
                     f"`{af['name'][:60]}` ({af['kind']}, {af['us']:.1f}) |")
    L += ["", "Every profiled step (is the picked one typical?):", "",
          "| step | kernels | kernel sum ms | GPU busy ms | gaps ms | span ms | host ms |", "|" + "---|" * 7]
    for i, s in enumerate(p["per_step"]):
        L.append(f"| {i}{' (picked)' if i == p['step'] else ''} | {s['kernels']} | {s['kernel_ms']:.3f} | "
                 f"{s['busy_ms']:.3f} | {s['gap_ms']:.3f} | {s['span_ms']:.3f} | "
                 f"{s.get('host_ms', float('nan')):.3f} |")
    m = p["mean"]
    L += ["", f"Mean over the {m['steps']} profiled steps, by kernel name (top 30 of {len(m['kernels'])}; "
          f"{m['kernels_per_step']:.0f} kernels per step, {busy:.3f} ms busy in the picked step):", "",
          "| kernel | kind | calls | us |", "|---|---|---|---|"]
    L += [f"| `{k['name'][:80]}` | {k['kind']} | {k['calls']:.1f} | {k['us']:.1f} |" for k in m["kernels"][:30]]
    if png:
        L += ["", f"![the step's kernels along time, by kind]({png})"]
    return L


def _attention_layers_md(a: dict | None) -> list[str]:
    """The host-tier attention layers' critical sections (breakdown.attention_layers)."""
    if not a:
        return []
    m, t = a["mean_us"], a["sum_ms"]
    cols = ("lead", "pcie_busy", "pcie_idle", "tail", "layer")
    return [f"The {len(a['layers'])} attention layers, each from its rotary kernel to its last attention kernel: lead "
            "(before the first host gather: the first read group's selection, PCIe idle), PCIe busy (host gathers "
            "running), PCIe idle inside the reads (composes, waits for the next group's selection), tail (after the "
            "last gather: key base, attention) (`profile.attention_layers`):", "",
            "| | lead | PCIe busy | PCIe idle between reads | tail | layer |", "|---|---|---|---|---|---|",
            "| mean us per layer | " + " | ".join(f"{m[c]:.1f}" for c in cols) + " |",
            "| ms per step | " + " | ".join(f"{t[c]:.3f}" for c in cols) + " |", ""]


def _graph_md(p: dict) -> list[str]:
    """The graph replay's part of the step (kernels launched by cudaGraphLaunch), and what lies outside it."""
    g = p["timeline"]["totals"].get("graph")
    if not g:
        return []
    return [f"The graph replay: {g['kernels']} kernels from {g['start_ms']:.3f} ms, span {g['span_ms']:.3f} ms = "
            f"busy {g['busy_ms']:.3f} + gaps {g['gap_ms']:.3f} ms ({g['gaps']} gaps). Outside it: the step's eager "
            "work (inputs; after it the lm_head GEMM and sampling) and the host's launch, slower under the profiler (it records every host op): "
            f"the timed steps spent {p.get('step_ms_mean', float('nan')) - g['span_ms']:.3f} ms outside the graph "
            "(step mean - graph span).", ""]


def table(r: dict) -> str:
    """The short summary printed last."""
    d, f = r["decode"], r["floor"]
    rows = [("step ms (mean of %d %s steps)" % (d["steps"], "graph" if d["graphs"] else "eager"),
             f"{d['step_ms_mean']:.3f}"),
            ("tok/s", f"{d['tok_s']:.1f}"),
            ("floor ms (fraction)", f"{f['ms']:.3f} ({f['fraction']:.1%})")]
    if "graph_replay_ms_mean" in d:
        rows.append(("graph replay / outside it ms", f"{d['graph_replay_ms_mean']:.3f} / {d['outside_graph_ms_mean']:.3f}"))
    if d.get("speculative"):
        rows.append(("speculative", _spec_note(d)))
    p = r["profile"]
    if p and "timeline" in p:
        t = p["timeline"]["totals"]
        g = t.get("graph")
        rows += [("kernels / step", str(t["kernels"]) + (f" ({g['kernels']} in the graph)" if g else "")),
                 ("kernel sum / GPU busy ms", f"{t['kernel_ms']:.3f} / {t['busy_ms']:.3f}"),
                 ("gaps ms (count)", f"{t['gap_ms']:.3f} ({t['gaps']})" +
                  (f"; in the graph {g['gap_ms']:.3f} ({g['gaps']}) of its {g['span_ms']:.3f} ms span" if g else "")),
                 ("span / host / host in graph launch ms", f"{t['span_ms']:.3f} / {t.get('host_ms', float('nan')):.3f}"
                  f" / {t.get('launch_ms', float('nan')):.3f}")]
        a = p.get("attention_layers")
        if a:
            rows.append(("attention layers ms: lead / PCIe / idle / tail = sum",
                         " / ".join(f"{a['sum_ms'][c]:.2f}" for c in ("lead", "pcie_busy", "pcie_idle",
                                                                        "tail")) + f" = {a['sum_ms']['layer']:.2f}"))
        rows += [(f"  {k}", f"{v['ms']:.3f} ms, {v['count']} kernels")
                 for k, v in list(p["timeline"]["by_kind"].items())[:8]]
    elif p:
        rows += [(f"  {k} (eager, timed region)", f"{v:.3f} ms") for k, v in p["ms"].items() if v > 0]
    w = max(len(a) for a, _ in rows)
    return "\n".join([_title(r) + f" on {r['info']['device']}"] + [f"  {a:<{w}}  {b}" for a, b in rows])


def plot(r: dict, path: str) -> None:
    """The picked step's kernels as bars along time (one lane per stream, a lane of the GPU's idle gaps),
    colored by kind; beside it, ms per kind and the gaps."""
    plt = C.pyplot()
    tl = r["profile"]["timeline"]
    ks, t = tl["kernels"], tl["totals"]
    kinds = list(tl["by_kind"])
    cmap = plt.get_cmap("tab20")
    color = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, 2.2 + 0.45 * (t["streams"] + 1) + 0.15 * len(kinds)),
                                 gridspec_kw={"width_ratios": [4, 1]})
    lanes = t["streams"]
    for k in kinds:
        for s in range(lanes):
            bars = [(x["start_us"] / 1e3, max(x["us"], 0.5) / 1e3) for x in ks if x["kind"] == k and x["stream"] == s]
            if bars:
                ax.broken_barh(bars, (lanes - s - 0.4, 0.8), color=color[k], linewidth=0)
    g = t.get("graph")
    if g:
        ax.axvspan(g["start_ms"], g["start_ms"] + g["span_ms"], color="0.92", zorder=0, label="graph replay")
        ax.legend(loc="upper right", fontsize=7)
    gaps = [((x["start_us"] - x["gap_us"]) / 1e3, x["gap_us"] / 1e3) for x in ks if x["gap_us"] > 0]
    ax.broken_barh(gaps, (-0.4, 0.8), color="crimson", linewidth=0)
    ax.set_yticks(range(lanes + 1), ["GPU idle"] + [f"stream {lanes - 1 - i}" for i in range(lanes)])
    ax.set_xlabel("ms from the step's first kernel")
    ax.set_xlim(0, t["span_ms"] * 1.01)
    ax.set_title(f"{t['kernels']} kernels: {t['kernel_ms']:.2f} ms of kernels, GPU busy {t['busy_ms']:.2f} ms, "
                 f"idle {t['gap_ms']:.2f} ms in {t['gaps']} gaps (span {t['span_ms']:.2f} ms)", fontsize=9)
    names = kinds + ["GPU idle (gaps)"]
    vals = [tl["by_kind"][k]["ms"] for k in kinds] + [t["gap_ms"]]
    bx.barh(range(len(names)), vals, color=[color[k] for k in kinds] + ["crimson"])
    bx.set_yticks(range(len(names)), [f"{k} ({tl['by_kind'][k]['count']})" for k in kinds] + names[-1:], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("ms in the step (kernel count)")
    d, f = r["decode"], r["floor"]
    fig.suptitle(f"{_title(r)} on {r['info']['device']} ({r['info']['date'][:10]}): step {d['step_ms_mean']:.2f} ms, "
                 f"floor {f['ms']:.2f} ms ({f['fraction']:.0%})", fontsize=10)
    fig.text(0.01, 0.005, r["info"]["command"][:220], fontsize=6.5, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
