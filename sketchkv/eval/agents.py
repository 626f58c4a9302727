"""`sketchkv eval agents`: multi-turn recall over one long document, as agents ask — dense vs sparse decode vs a
prune-at-prefill baseline.

A conversation: held-out code of about `--length` tokens with `--turns` far-apart parts spliced in at spread
depths (2%-92%), each a lookup registry (`NAME = {"k_xxxx": 0xhhhhhh, ...}`) or a held-out function (the kinds
cycle through `--kinds`); scripts/reference_data.py's generators build them, as in the reference model's own
evaluation. Then one question per part, in shuffled order, one turn each: a lookup question is
`assert NAME["k_xxxx"] ==` (answer: the value), a copy question is the function's signature (answer: its body).
Each turn re-sends the whole conversation so far (document + earlier questions + the model's own greedy answers
+ the new question) as a new request, so the prefix cache serves the shared prefix; the answer is generated
greedily (as many tokens as the gold answer) and scored by exact match.

Configurations: dense; each candidate (default: sparse decode with the seed's knobs scaled to the model); and
`prune`: the SnapKV / TokenGate-style baseline of `sketchkv.eval.prune` on a dense engine — after the first
turn's prefill it keeps, per KV head, the sinks + top-k tokens by attention from the first question + the recent
window (the same sinks / top-k / recent budget as the first sparse candidate, i.e. sparse's tokens per step)
and drops the rest of the document for every later turn. The report gives accuracy per question index
(question 1 vs the follow-ups), prefix-cache hits, and for `prune` how much of each asked part survived the
pruning: the follow-up failures line up with parts that were dropped.
"""
from __future__ import annotations

import argparse
import os
import random
import time

from sketchkv.eval import common as C

DEFAULT_LENGTHS = [16384, 65536, 131072]
KINDS = ("lookup", "copy")


def add_args(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, "agents")
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS, help="conversation lengths in tokens")
    p.add_argument("--samples", type=int, default=8, help="conversations per length")
    p.add_argument("--turns", type=int, default=4, help="questions per conversation (one part each)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="part kinds, cycled")
    p.add_argument("--registry", type=int, default=8, help="entries per lookup registry")
    g = p.add_argument_group("prune-at-prefill baseline (default budget: the first sparse candidate's)")
    g.add_argument("--no-prune", action="store_true", help="skip the baseline")
    g.add_argument("--prune-sinks", type=int, default=None)
    g.add_argument("--prune-top-k", type=int, default=None)
    g.add_argument("--prune-recent", type=int, default=None)
    g.add_argument("--prune-window", type=int, default=None,
                   help="observation window (default: the first question's tokens)")
    g.add_argument("--prune-pool", type=int, default=7, help="max-pool width over positions (SnapKV: 7)")
    g.add_argument("--prune-shared", action="store_true", help="one kept set per layer (default: per KV head)")
    C.add_engine_args(p)


def main(args: argparse.Namespace) -> dict:
    if args.from_json:
        return C.replot(args.from_json, markdown, plot, args.out_dir)
    prune = None if args.no_prune else {"sinks": args.prune_sinks, "top_k": args.prune_top_k,
                                        "recent": args.prune_recent, "window": args.prune_window,
                                        "pool": args.prune_pool, "shared": args.prune_shared}
    return run_agents(args.model, args.data, args.lengths, args.samples, args.turns, args.kinds, args.candidate,
                      args.registry, prune, args.seed, args.out_dir or "eval-results", args.name, C.base_options(args),
                      quiet=args.quiet)


# ----------------------------------------------------------------------------------------------------------
# Conversations
# ----------------------------------------------------------------------------------------------------------
def build_conversation(tok, hd, rng: random.Random, length: int, turns: int, kinds, n_entries: int) -> dict:
    rd = C.require_reference_data()
    names = rng.sample(rd.REGISTRY_NAMES, min(turns, len(rd.REGISTRY_NAMES)))
    parts, used_funcs = [], set()
    for j in range(turns):
        kind = kinds[j % len(kinds)]
        if kind == "copy":
            # a held-out function not used yet, short enough that all parts fit well inside the document
            for _ in range(200 if hd.funcs else 0):
                src, sig_len = hd.funcs[rng.randrange(len(hd.funcs))]
                first = src.splitlines()[0]
                if first not in used_funcs and len(tok.encode(src, add_special_tokens=False).ids) < length // (
                        3 * turns):
                    used_funcs.add(first)
                    parts.append({"kind": kind, "snippet": src, "question": src, "a": sig_len, "b": len(src),
                                  "about": first})
                    break
            else:
                kind = "lookup"  # no function fits: this part becomes a lookup
        if kind == "lookup":
            reg = rd.make_registry(rng, n_entries, constants=False, key_style=0, value_style=0)
            reg.name = names[j] if j < len(names) else f"{names[j % len(names)]}_{j}"
            qi = rng.randrange(n_entries)
            line, a, b = reg.lookup(qi)
            parts.append({"kind": kind, "snippet": reg.definition(), "question": line, "a": a, "b": b,
                          "about": f"{reg.name}[{reg.entries[qi][0]!r}]", "needle": f'"{reg.entries[qi][0]}": '})
    count = lambda s: len(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    overhead = sum(count(p["snippet"]) + count(p["question"]) + 2 for p in parts) + 16
    for _ in range(20):
        filler = hd._filler(rng, max(length - overhead, 64))
        if not any(p["kind"] == "copy" and p["about"] in filler for p in parts):
            break
    # far-apart depths, one per part, assigned in random order
    depths = [0.02 + 0.9 * (j + rng.uniform(0.2, 0.8)) / turns for j in range(turns)]
    rng.shuffle(depths)
    text = filler
    for p, d in sorted(zip(parts, depths), key=lambda x: -x[1]):
        p["depth"] = d
        text, _ = hd._insert_at_line(text, d, p["snippet"])
    if not text.endswith("\n"):
        text += "\n"
    enc = tok.encode(text, add_special_tokens=False)
    starts = [s for s, _ in enc.offsets]
    import bisect
    for p in parts:
        c0 = text.find(p["snippet"])
        p["span"] = (bisect.bisect_left(starts, c0), bisect.bisect_left(starts, c0 + len(p["snippet"])))
        if "needle" in p:  # the asked registry entry's line: what the answer must be copied from
            n0 = c0 + p["snippet"].find(p["needle"])
            n1 = text.find("\n", n0) + 1
            p["target"] = (bisect.bisect_left(starts, n0), bisect.bisect_left(starts, n1))
        else:
            p["target"] = p["span"]
        qe = tok.encode(p["question"], add_special_tokens=False)
        k0, k1 = C.answer_span(qe.offsets, p["a"], p["b"])
        p["q_ids"], p["gold"], p["tail"] = qe.ids[:k0], qe.ids[k0:k1], qe.ids[k1:]
    order = list(range(turns))
    rng.shuffle(order)
    total = len(enc.ids) + sum(len(p["q_ids"]) + len(p["gold"]) + len(p["tail"]) + 2 for p in parts)
    return {"doc_ids": list(enc.ids), "parts": parts, "order": order, "tokens": total}


def run_conversation(llm, conv: dict, nl_ids: list[int], prune_layers=None, prune_window=None) -> list[dict]:
    from sketchkv.sampling_params import SamplingParams
    ids = list(conv["doc_ids"])
    out = []
    for t, pi in enumerate(conv["order"]):
        p = conv["parts"][pi]
        prompt = ids + p["q_ids"]
        if prune_layers and t == 0:
            for layer in prune_layers:
                layer.arm(len(prompt), prune_window or len(p["q_ids"]))
        sp = SamplingParams(temperature=0, max_tokens=len(p["gold"]), ignore_eos=True)
        res = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
        gen = list(res.token_ids)
        hits = sum(int(a == b) for a, b in zip(gen, p["gold"]))
        rec = {"turn": t + 1, "part": pi, "kind": p["kind"], "depth": round(p["depth"], 3),
               "exact": gen == p["gold"], "token_acc": hits / len(p["gold"]), "prompt_tokens": len(prompt),
               "cached_tokens": res.num_cached_tokens, "answer": gen}
        if prune_layers:
            fr = [layer.kept_fraction(*p["target"]) for layer in prune_layers]
            fr = [f for f in fr if f is not None]
            rec["part_kept"] = sum(fr) / len(fr) if fr else None
        out.append(rec)
        ids = prompt + gen + p["tail"]
        if not p["tail"] and gen != p["gold"]:
            ids += nl_ids  # a wrong body may not end its line: start the next question on a new one
    if prune_layers:
        for layer in prune_layers:
            layer.arm(None)
    return out


# ----------------------------------------------------------------------------------------------------------
# Run
# ----------------------------------------------------------------------------------------------------------
def run_agents(model: str, data: list[str] | None = None, lengths: list[int] | None = None, samples: int = 8,
               turns: int = 4, kinds=KINDS, candidates: list[str] | None = None, n_entries: int = 8,
               prune: dict | None = None, seed: int = 0, out_dir: str = "eval-results", name: str = "agents",
               base: dict | None = None, quiet: bool = False) -> dict:
    from tqdm import tqdm

    from sketchkv.errors import SketchKVError
    from sketchkv.eval.prune import install_prune
    from sketchkv.eval.recall import heldout_docs
    t_start = time.time()
    base = dict(base or {})
    model, max_pos = C.resolve_model(model)
    lengths = sorted(set(lengths or DEFAULT_LENGTHS))
    if turns < 2:
        raise SketchKVError("--turns must be >= 2 (the point is the follow-up questions)")
    kinds = [k for k in kinds if k in KINDS] or list(KINDS)
    cands = C.parse_candidates(candidates, max_pos)
    tok = C.load_tokenizer(model)
    docs, source = C.load_documents(data or [], model)
    hd = heldout_docs(tok, docs)
    nl_ids = tok.encode("\n", add_special_tokens=False).ids
    convs = []
    for L in lengths:
        target = min(L, max_pos - 64)
        for i in range(samples):
            for shrink in range(8):
                conv = build_conversation(tok, hd, random.Random(f"{seed}-agents-{L}-{i}"), target - 128 * shrink,
                                          turns, kinds, n_entries)
                if conv["tokens"] < max_pos - 8:
                    break
            conv.update(length=L, i=i)
            convs.append(conv)
    common = dict(base, sparse=False, enable_prefix_caching=True,
                  max_model_len=min(max_pos, max(c["tokens"] for c in convs) + 64))

    configs = [("dense", {}, "dense attention", None)]
    configs += [(c.name, c.options, c.note, None) for c in cands]
    prune_cfg = None
    if prune is not None:
        ref = next((c for c in cands if c.is_sparse), None)
        s0, k0, r0 = ref.sparse_budget() if ref else C.seed_default_candidate(max_pos).sparse_budget()
        prune_cfg = {"sinks": prune.get("sinks") if prune.get("sinks") is not None else s0,
                     "top_k": prune.get("top_k") if prune.get("top_k") is not None else k0,
                     "recent": prune.get("recent") if prune.get("recent") is not None else r0,
                     "window": prune.get("window"), "pool": prune.get("pool", 7),
                     "shared": bool(prune.get("shared")),
                     "budget_from": ref.name if ref else "the seed's defaults scaled to the model"}
        desc = (f"SnapKV-style prune at the first question: keep {prune_cfg['sinks']} sinks + top "
                f"{prune_cfg['top_k']} by attention from the first question"
                f" ({'its ' + str(prune_cfg['window']) + ' last prompt tokens' if prune_cfg['window'] else 'its tokens'}"
                f", max-pooled over {prune_cfg['pool']}) + {prune_cfg['recent']} recent, "
                f"{'per layer' if prune_cfg['shared'] else 'per KV head'}; budget = {prune_cfg['budget_from']}'s "
                f"tokens per step")
        configs.append(("prune", {"enforce_eager": True}, desc, prune_cfg))
    C.log(f"agents: {len(convs)} conversations ({samples} x lengths {lengths}), {turns} questions each "
          f"({'/'.join(kinds)}); configurations: {', '.join(c[0] for c in configs)}", quiet)

    results = {"info": C.run_info(model, base), "kind": "agents", "data": source,
               "settings": {"lengths": lengths, "samples": samples, "turns": turns, "kinds": kinds,
                            "registry_entries": n_entries, "seed": seed, "prune": prune_cfg},
               "conversations": [{"length": c["length"], "i": c["i"], "tokens": c["tokens"],
                                  "parts": [{k: p[k] for k in ("kind", "depth", "about", "span", "target")} | {
                                      "answer_tokens": len(p["gold"])} for p in c["parts"]],
                                  "order": c["order"]} for c in convs],
               "configs": {}}
    for cname, opts, desc, pcfg in configs:
        t0 = time.time()
        llm = C.make_llm(model, {**common, **opts})
        layers = install_prune(llm, pcfg["sinks"], pcfg["top_k"], pcfg["recent"], pcfg["pool"], pcfg["shared"]) \
            if pcfg else None
        sched = llm.engine.scheduler
        q0, h0 = sched.prefix_queries, sched.prefix_hits
        turns_out = []
        for conv in tqdm(convs, desc=f"agents {cname}", unit="conv", disable=quiet):
            recs = run_conversation(llm, conv, nl_ids, layers, pcfg["window"] if pcfg else None)
            for r in recs:
                r.update(length=conv["length"], i=conv["i"])
            turns_out += recs
        q, h = sched.prefix_queries - q0, sched.prefix_hits - h0
        C.release(llm)
        del llm, sched
        entry = {"options": opts, "description": desc, "seconds": round(time.time() - t0, 1),
                 "prefix_cache_hit_rate": h / q if q else None, "by_length": summarize(turns_out, lengths, turns),
                 "turns": turns_out}
        results["configs"][cname] = entry
        C.save_partial(results, out_dir, name)
        C.log(f"agents {cname}: " + "; ".join(
            f"{C.fmt_len(L)} Q1 {C.fmt(b['first'], '.2f')} follow-ups {C.fmt(b['followups'], '.2f')}"
            for L, b in ((L, entry["by_length"][str(L)]) for L in lengths)) + f" [{entry['seconds']}s]", quiet)
    results["seconds"] = round(time.time() - t_start, 1)
    write_outputs(results, out_dir, name)
    return results


def summarize(recs: list[dict], lengths, turns) -> dict:
    out = {}
    for L in lengths:
        rs = [r for r in recs if r["length"] == L]
        by_turn = []
        for t in range(1, turns + 1):
            x = [r for r in rs if r["turn"] == t]
            kept = [r["part_kept"] for r in x if r.get("part_kept") is not None]
            by_turn.append({"n": len(x), "exact": sum(r["exact"] for r in x) / len(x) if x else None,
                            "token_acc": sum(r["token_acc"] for r in x) / len(x) if x else None,
                            "part_kept": sum(kept) / len(kept) if kept else None})
        first = [r for r in rs if r["turn"] == 1]
        follow = [r for r in rs if r["turn"] > 1]
        kept_f = [r["part_kept"] for r in follow if r.get("part_kept") is not None]
        by_kind = {}
        for k in sorted({r["kind"] for r in rs}):
            xs = [r for r in follow if r["kind"] == k]
            by_kind[k] = sum(r["exact"] for r in xs) / len(xs) if xs else None
        out[str(L)] = {"by_turn": by_turn,
                       "first": sum(r["exact"] for r in first) / len(first) if first else None,
                       "followups": sum(r["exact"] for r in follow) / len(follow) if follow else None,
                       "followups_by_kind": by_kind,
                       "followup_part_kept": sum(kept_f) / len(kept_f) if kept_f else None,
                       "followups_exact_when_part_mostly_dropped": _cond(follow, lambda r: r["part_kept"] < 0.5),
                       "followups_exact_when_part_mostly_kept": _cond(follow, lambda r: r["part_kept"] >= 0.5)}
    return out


def _cond(recs, pred):
    xs = [r for r in recs if r.get("part_kept") is not None and pred(r)]
    return {"n": len(xs), "exact": sum(r["exact"] for r in xs) / len(xs) if xs else None}


# ----------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------
def write_outputs(results: dict, out_dir: str, name: str) -> dict:
    return C.write_outputs(results, out_dir, name, markdown, plot)


def markdown(r: dict, png: str) -> str:
    s = r["settings"]
    T = s["turns"]
    lines = C.report_header("Multi-turn agent recall", r) + [
             f"- {s['samples']} conversations per length, seed {s['seed']}: one document with {T} far-apart parts "
             f"({'/'.join(s['kinds'])}, cycled) at spread depths, then {T} questions, one per part, in shuffled "
             "order; every turn re-sends the whole conversation (prefix cache) and the answer is generated "
             "greedily; exact match", "", "## Configurations", ""]
    for n, e in r["configs"].items():
        opts = ", ".join(f"{k}={v}" for k, v in e["options"].items()) or "dense"
        lines.append(f"- `{n}`: {opts}" + (f" — {e['description']}" if e["description"] else "")
                     + f" ({e['seconds']} s)")
    lines += ["", "## Exact match by question", "",
              "| context | configuration | " + " | ".join(f"Q{t}" for t in range(1, T + 1)) +
              " | first question | follow-ups (Q2+) | prefix-cache hit rate |",
              "|---:|---|" + "---:|" * (T + 3)]
    for L in s["lengths"]:
        for n, e in r["configs"].items():
            b = e["by_length"][str(L)]
            cells = [C.fmt(x["exact"], ".2f") for x in b["by_turn"]]
            lines.append(f"| {C.fmt_len(L)} | {n} | " + " | ".join(cells) + f" | {C.fmt(b['first'], '.2f')} | "
                         f"**{C.fmt(b['followups'], '.2f')}** | {C.fmt(e['prefix_cache_hit_rate'], '.2f')} |")
    if "prune" in r["configs"]:
        p = r["configs"]["prune"]
        lines += ["", "## What the pruning kept", "",
                  "Fraction of the asked part's tokens (the asked registry entry's line; the whole function for "
                  "copy) still attended after the prune (mean over layers and KV heads), and the prune baseline's "
                  "follow-up accuracy split by it:", "",
                  "| context | " + " | ".join(f"Q{t} part kept" for t in range(1, T + 1)) +
                  " | follow-ups: part mostly dropped (<50%) | follow-ups: part mostly kept |",
                  "|---:|" + "---:|" * (T + 2)]
        for L in s["lengths"]:
            b = p["by_length"][str(L)]
            dr, kp = b["followups_exact_when_part_mostly_dropped"], b["followups_exact_when_part_mostly_kept"]
            lines.append(f"| {C.fmt_len(L)} | " + " | ".join(C.fmt(x["part_kept"], ".2f") for x in b["by_turn"]) +
                         f" | {C.fmt(dr['exact'], '.2f')} (n={dr['n']}) | {C.fmt(kp['exact'], '.2f')} "
                         f"(n={kp['n']}) |")
    lines += ["", "## Summary", ""]
    for L in s["lengths"]:
        parts = [f"{n}: Q1 {C.fmt(e['by_length'][str(L)]['first'], '.2f')}, follow-ups "
                 f"{C.fmt(e['by_length'][str(L)]['followups'], '.2f')}" for n, e in r["configs"].items()]
        lines.append(f"- {C.fmt_len(L)}: " + "; ".join(parts))
    lines += ["", f"![accuracy by question]({png})", "", f"Total time {r.get('seconds', '–')} s.", ""]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    plt = C.pyplot()
    Ls = r["settings"]["lengths"]
    T = r["settings"]["turns"]
    fig, axes = plt.subplots(1, len(Ls), figsize=(5.5 * len(Ls), 4.4), squeeze=False)
    for ax, L in zip(axes[0], Ls):
        for j, (n, e) in enumerate(r["configs"].items()):
            ys = [x["exact"] for x in e["by_length"][str(L)]["by_turn"]]
            ax.plot(range(1, T + 1), ys, marker="os^vD<>"[j % 7], lw=2.5 if n == "dense" else 1.6,
                    ls="--" if n == "dense" else "-", label=n, alpha=0.85)
        ax.set_xticks(range(1, T + 1))
        ax.set_xticklabels(["Q1 (prune\nchooses here)" if t == 1 else f"Q{t}" for t in range(1, T + 1)])
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel("greedy exact match")
        ax.set_title(f"{C.fmt_len(L)}-token conversation")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{os.path.basename(r['info']['model'].rstrip('/'))}: follow-up questions about other parts "
                 f"({r['settings']['samples']} conversations per length, {r['info']['device']})", fontsize=10)
    C.save_figure(fig, path)
