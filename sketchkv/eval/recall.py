"""`sketchkv eval recall`: long-range needle recall built from held-out code, dense vs each candidate.

Documents come from scripts/reference_data.py's `HeldoutDocs` (the generators the reference model's own
evaluation uses, with the same per-sample seeds `"{seed}-{kind}-{length}-{i}"`, so dense numbers here are
comparable with benchmarks/results/reference-model.md):

* lookup: a `REGISTRY = {"k_xxxx": 0xhhhhhh, ...}` dict of `--registry` random entries inserted at 1-5% depth in
  held-out code, and at the very end `assert REGISTRY["k_xxxx"] ==`; the model must produce the value;
* copy: a held-out function inserted at 1-5% depth and repeated at the end; given its signature, the model must
  produce its body.

Greedy exact match, computed by teacher forcing through the engine (`LLM.teacher_force`): greedy decoding
reproduces the answer iff the argmax at every answer position, given the true prefix, is the answer token. The
token before the answer is forced too, so every answer token is predicted by a decode step (sparse decode
applies to all of them; a plain prompt would get the first one from the dense prefill). `--check-generate N`
confirms the equivalence with real greedy generation on the first N documents of the shortest length.
Documents run one at a time (a batch would mix prefill chunks into decode steps, which run dense).
"""
from __future__ import annotations

import argparse
import os
import random
import time

from sketchkv.eval import common as C

DEFAULT_LENGTHS = [4096, 16384, 65536, 131072, 262144]
KINDS = ("lookup", "copy")


def add_args(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, "recall")
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS, help="document lengths in tokens")
    p.add_argument("--samples", type=int, default=20, help="documents per length and kind")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--registry", type=int, default=8, help="entries in the lookup registry (one is asked)")
    p.add_argument("--check-generate", type=int, default=0, metavar="N",
                   help="also run real greedy generation on the first N documents of the shortest length")
    C.add_engine_args(p)


def main(args: argparse.Namespace) -> dict:
    if args.from_json:
        return C.replot(args.from_json, markdown, plot, args.out_dir)
    return run_recall(args.model, args.data, args.lengths, args.samples, args.kinds, args.candidate, args.registry,
                      args.seed, args.out_dir or "eval-results", args.name, C.base_options(args), args.check_generate,
                      quiet=args.quiet)


# ----------------------------------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------------------------------
def heldout_docs(tok, docs):
    """scripts/reference_data.HeldoutDocs over the given documents (held-out text + function pool)."""
    rd = C.require_reference_data()
    files = [rd.SourceFile(d.rel, d.package, len(d.text)) for d in docs]
    texts = {d.rel: d.text for d in docs}
    text, starts = rd.heldout_text(files, texts)
    funcs = rd.function_pool(texts, 1, 5000, seed=123)
    _, tok_starts = rd.encode_with_offsets(tok, text, starts)
    return rd.HeldoutDocs(tok, text, starts, funcs, tok_starts=tok_starts)


def build_documents(tok, hd, lengths, kinds, samples, n_entries, seed, max_len) -> list[dict]:
    """Token ids and answer span of every (length, kind, sample); lengths clipped to the model's limit."""
    out = []
    for L in lengths:
        target = min(L, max_len - 8)
        for kind in kinds:
            for i in range(samples):
                rec = {"length": L, "kind": kind, "i": i}
                try:
                    for shrink in range(8):  # rebuild a little shorter if tokenization overshoots the limit
                        rng = random.Random(f"{seed}-{kind}-{L}-{i}")
                        t = target - shrink * 64
                        doc = hd.lookup_doc(rng, t, n_entries) if kind == "lookup" else hd.copy_doc(rng, t)
                        enc = tok.encode(doc.text, add_special_tokens=False)
                        if len(enc.ids) < max_len - 1:
                            break
                    k0, k1 = C.answer_span(enc.offsets, doc.answer_start, doc.answer_end)
                    rec.update(ids=list(enc.ids), k0=k0, k1=k1,
                               meta={k: v for k, v in doc.meta.items() if k in ("key", "value", "depth", "signature")})
                except RuntimeError as e:  # e.g. no held-out function short enough for this length
                    rec["error"] = str(e)[:200]
                out.append(rec)
    return out


# ----------------------------------------------------------------------------------------------------------
# Run
# ----------------------------------------------------------------------------------------------------------
def score_document(llm, d: dict) -> tuple[bool, float, list[int]]:
    """Greedy exact match and token accuracy of the answer, by teacher forcing from the token before it."""
    ids, k0, k1 = d["ids"], d["k0"], d["k1"]
    rows = llm.teacher_force([ids[:k0 - 1]], [ids[k0 - 1:k1]])[0][1:]
    pred = rows.argmax(-1).tolist()
    target = ids[k0:k1]
    hits = [int(p == t) for p, t in zip(pred, target)]
    return pred == target, sum(hits) / len(target), pred


def generate_answer(llm, d: dict) -> list[int]:
    from sketchkv.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=d["k1"] - d["k0"], ignore_eos=True)
    return llm.generate(prompt_token_ids=[d["ids"][:d["k0"]]], sampling_params=sp)[0].token_ids


def run_recall(model: str, data: list[str] | None = None, lengths: list[int] | None = None, samples: int = 20,
               kinds=KINDS, candidates: list[str] | None = None, n_entries: int = 8, seed: int = 0,
               out_dir: str = "eval-results", name: str = "recall", base: dict | None = None,
               check_generate: int = 0, quiet: bool = False) -> dict:
    from tqdm import tqdm
    t_start = time.time()
    base = dict(base or {})
    model, max_pos = C.resolve_model(model)
    lengths = sorted(set(lengths or DEFAULT_LENGTHS))
    kinds = [k for k in KINDS if k in kinds]
    cands = C.parse_candidates(candidates, max_pos)
    tok = C.load_tokenizer(model)
    docs, source = C.load_documents(data or [], model)
    hd = heldout_docs(tok, docs)
    documents = build_documents(tok, hd, lengths, kinds, samples, n_entries, seed, max_pos)
    ok_docs = [d for d in documents if "ids" in d]
    if not ok_docs:
        from sketchkv.errors import SketchKVError
        raise SketchKVError("no recall document could be built (held-out text without usable functions?)")
    need_len = max(len(d["ids"]) for d in ok_docs) + 2
    common = dict(base, sparse=False, enable_prefix_caching=False, max_model_len=min(need_len, max_pos))
    C.log(f"recall: {len(docs)} held-out files, {len(hd.funcs)} functions for copy; {len(ok_docs)} documents "
          f"({samples} x {kinds} x lengths {lengths})", quiet)

    configs = [("dense", {}, "dense attention")] + [(c.name, c.options, c.note) for c in cands]
    results = {"info": C.run_info(model, base), "kind": "recall", "data": source,
               "settings": {"lengths": lengths, "samples": samples, "kinds": kinds, "registry_entries": n_entries,
                            "seed": seed, "method": "greedy exact match by teacher forcing; every answer token "
                                                    "predicted by a decode step; one document at a time"},
               "documents": {f"{d['length']}/{d['kind']}/{d['i']}": {"tokens": len(d.get("ids", [])),
                                                                      "answer_tokens": d.get("k1", 0) - d.get("k0", 0),
                                                                      **({"error": d["error"]} if "error" in d else
                                                                         d["meta"])} for d in documents},
               "configs": {}}
    shortest = lengths[0]
    for cname, opts, desc in configs:
        t0 = time.time()
        llm = C.make_llm(model, {**common, **opts})
        per = {}
        gen_checks = []
        for d in tqdm(ok_docs, desc=f"recall {cname}", unit="doc", disable=quiet):
            exact, acc, pred = score_document(llm, d)
            p = per.setdefault((d["length"], d["kind"]), {"exact": [], "token_acc": [], "doc_tokens": []})
            p["exact"].append(bool(exact))
            p["token_acc"].append(acc)
            p["doc_tokens"].append(len(d["ids"]))
            if d["length"] == shortest and d["i"] < check_generate:
                gen = generate_answer(llm, d)
                gen_checks.append({"doc": f"{d['length']}/{d['kind']}/{d['i']}", "teacher_forced_exact": bool(exact),
                                   "generate_exact": gen == d["ids"][d["k0"]:d["k1"]]})
        C.release(llm)
        del llm
        by_length = {}
        for L in lengths:
            row = {}
            for kind in kinds:
                p = per.get((L, kind))
                n_err = sum(1 for d in documents if d["length"] == L and d["kind"] == kind and "error" in d)
                if not p:
                    row[kind] = {"n": 0, "exact": None, "token_acc": None, "skipped": n_err}
                    continue
                n = len(p["exact"])
                row[kind] = {"n": n, "exact": sum(p["exact"]) / n, "token_acc": sum(p["token_acc"]) / n,
                             "mean_doc_tokens": sum(p["doc_tokens"]) / n, "per_sample": p["exact"], "skipped": n_err}
            by_length[str(L)] = row
        entry = {"options": opts, "description": desc, "seconds": round(time.time() - t0, 1), "by_length": by_length}
        if gen_checks:
            entry["generate_check"] = gen_checks
        results["configs"][cname] = entry
        C.save_partial(results, out_dir, name)
        C.log(f"recall {cname}: " + "; ".join(
            f"{C.fmt_len(L)} " + " ".join(f"{k} {C.fmt(by_length[str(L)][k]['exact'], '.2f')}" for k in kinds)
            for L in lengths) + f" [{entry['seconds']}s]", quiet)

    # per-sample agreement with dense: recall "equal to dense" means the same documents answered
    dense = results["configs"]["dense"]["by_length"]
    for cname, e in results["configs"].items():
        for L, row in e["by_length"].items():
            for kind, r in row.items():
                if r.get("per_sample") is not None:
                    ds = dense[L][kind]["per_sample"]
                    r["lost_vs_dense"] = sum(1 for a, b in zip(ds, r["per_sample"]) if a and not b)
                    r["gained_vs_dense"] = sum(1 for a, b in zip(ds, r["per_sample"]) if b and not a)
    results["seconds"] = round(time.time() - t_start, 1)
    write_outputs(results, out_dir, name)
    return results


# ----------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------
def write_outputs(results: dict, out_dir: str, name: str) -> dict:
    return C.write_outputs(results, out_dir, name, markdown, plot)


def markdown(r: dict, png: str) -> str:
    s = r["settings"]
    kinds = s["kinds"]
    lines = C.report_header("Long-range recall", r) + [
             f"- {s['samples']} documents per length and kind, seed {s['seed']}; lookup registry of "
             f"{s['registry_entries']} entries at 1-5% depth; copy: a held-out function at 1-5% depth repeated at "
             f"the end", f"- method: {s['method']}", "", "## Configurations", ""]
    for n, e in r["configs"].items():
        opts = ", ".join(f"{k}={v}" for k, v in e["options"].items()) or "dense"
        lines.append(f"- `{n}`: {opts}" + (f" — {e['description']}" if e["description"] else "")
                     + f" ({e['seconds']} s)")
    head = "| context | " + " | ".join(f"{n} {k}" for n in r["configs"] for k in kinds) + " |"
    lines += ["", "## Greedy exact match", "", head, "|---:|" + "---:|" * (len(r["configs"]) * len(kinds))]
    for L in s["lengths"]:
        cells = []
        for n, e in r["configs"].items():
            for k in kinds:
                x = e["by_length"][str(L)][k]
                lost = x.get("lost_vs_dense")
                extra = f" (−{lost})" if lost else ""
                cells.append(f"{C.fmt(x['exact'], '.2f')}{extra} n={x['n']}")
        lines.append(f"| {C.fmt_len(L)} | " + " | ".join(cells) + " |")
    lines += ["", "(−m): documents dense answers exactly that this configuration does not.", "",
              "## Token accuracy", "", head, "|---:|" + "---:|" * (len(r["configs"]) * len(kinds))]
    for L in s["lengths"]:
        cells = [C.fmt(e["by_length"][str(L)][k]["token_acc"], ".3f") for e in r["configs"].values() for k in kinds]
        lines.append(f"| {C.fmt_len(L)} | " + " | ".join(cells) + " |")
    checks = [(n, c) for n, e in r["configs"].items() for c in e.get("generate_check", [])]
    if checks:
        agree = sum(c["teacher_forced_exact"] == c["generate_exact"] for _, c in checks)
        lines += ["", f"Generation check: teacher-forced exact match agrees with real greedy generation on "
                      f"{agree}/{len(checks)} documents."]
    lines += ["", f"![recall vs context length]({png})", "", f"Total time {r.get('seconds', '–')} s.", ""]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    plt = C.pyplot()
    Ls = r["settings"]["lengths"]
    kinds = r["settings"]["kinds"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for j, (n, e) in enumerate(r["configs"].items()):
            ys = [e["by_length"][str(L)][kind]["exact"] for L in Ls]
            pts = [(L, y) for L, y in zip(Ls, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^vD<>"[j % 7],
                        ls="--" if n == "dense" else "-", lw=2.5 if n == "dense" else 1.5, label=n, alpha=0.85)
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ls)
        ax.set_xticklabels([C.fmt_len(L) for L in Ls])
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("greedy exact match")
        ax.set_title(f"{kind} recall")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{os.path.basename(r['info']['model'].rstrip('/'))}: {r['settings']['samples']} documents per "
                 f"point ({r['info']['device']})", fontsize=10)
    C.save_figure(fig, path)
