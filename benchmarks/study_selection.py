"""Why does sparse decode lose lookups? A CPU study of the key-sketch selection (issue 4).

Runs the reference model dense over the lookup documents of `sketchkv eval recall` (same generators and
seeds), teacher-forced, and records at every answer decode step of every full-attention layer the
post-RoPE query heads and the whole cached key set. Offline it then replays the selection of many
variants on exactly those queries and keys and measures, per (doc, step, layer):

* mass recall: the share of the dense softmax attention mass (per query head) that lands in
  sinks + picks + recent (`mass`), and the share of the mass outside sinks + recent that the picks
  cover (`cand`: the part the selector is responsible for);
* top-token hits: whether each query head's most-attended token outside sinks + recent is picked
  (`top1`), restricted to the heads that put >= 5% of their mass there (`top1@5%`: the retrieval events).

Variants: basis (PCA of keys at rank 16/32/64 = the shipped method; `unc` = PCA of raw, uncentered keys; `qk` = a query-aware asymmetric
basis, the rank-r SVD of E[qq^T]^1/2 Cov(k)^1/2, whose query side differs from the key side; `exact` =
no sketch), int4 vs exact projected scores, how the G query heads of a KV group are combined (`sum`:
sum of queries, then score = the engine's current rule; `max`: max of per-head scores; `softmax`: sum of
per-head softmax probabilities over the candidates), and shared (one pick for all KV heads) vs per-KV-head
picks. Bases are fitted from first/second moments of keys and queries collected over the calibration
set shipped with the model (cached in --cache-dir).

    python benchmarks/study_selection.py --lengths 8192 16384 --samples 3 --calib-tokens 32768

Writes OUT_DIR/NAME.json, NAME.png and NAME-tables.md (NAME.md is left for a written report);
`--from-json NAME.json` rewrites the tables and plot without running anything. Captures and moments
are cached in --cache-dir, so a rerun with other variants or k ratios costs only the replay.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sketchkv.eval import common as C  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    from sketchkv.config import default_model
    p.add_argument("--model", default=default_model())
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--samples", type=int, default=4, help="lookup documents per length")
    p.add_argument("--k-ratios", type=float, nargs="+", default=[0.0075, 0.015, 0.03],
                   help="top_k as a fraction of the context (H200 case: 2048/65536 = 0.031)")
    p.add_argument("--sinks", type=int, default=64)
    p.add_argument("--recent-ratio", type=float, default=1 / 64, help="recent window / context (H200: 1024/65536)")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--calib-tokens", type=int, default=262144, help="calibration tokens for the moments")
    p.add_argument("--basis", default=None, help="also evaluate this basis file (e.g. the shipped one)")
    p.add_argument("--cache-dir", default="/tmp/sketchkv-study", help="captured queries/keys and moments")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default="selection-study")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--from-json", metavar="NAME.json", help="run nothing: rewrite NAME.md / NAME.png from a saved result")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# Capture (engine, dense)
# ----------------------------------------------------------------------------------------------------------
def attention_layers(llm):
    from sketchkv.layers.attention import Attention
    return [m for n, m in llm.engine.model.named_modules() if isinstance(m, Attention) and not n.startswith("mtp.")]


def collect_moments(llm, tokens: int, quiet: bool) -> dict:
    """Per layer and KV head: key mean / covariance and query second moment E[q q^T] (over the G heads)."""
    from tqdm import tqdm
    from sketchkv.kv.fit_basis import calibration_texts, default_calibration
    from sketchkv.sampling_params import SamplingParams
    layers = attention_layers(llm)
    a = layers[0]
    L, H, G, D = len(layers), a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim
    st = {"n": 0, "ksum": torch.zeros(L, H, D, dtype=torch.float64), "kk": torch.zeros(L, H, D, D, dtype=torch.float64),
          "qq": torch.zeros(L, H, D, D, dtype=torch.float64)}

    def hook(mod, args, j):
        q, k = args[0].double(), args[1].double()
        st["ksum"][j] += k.sum(0)
        st["kk"][j] += torch.einsum("thd,the->hde", k, k)
        qg = q.view(q.shape[0], H, G, D)
        st["qq"][j] += torch.einsum("thgd,thge->hde", qg, qg) / G
        if j == 0:
            st["n"] += k.shape[0]

    hooks = [m.register_forward_pre_hook(lambda mod, args, j=j: hook(mod, args, j)) for j, m in enumerate(layers)]
    ids = []
    for _, text in calibration_texts([default_calibration()]):
        ids += llm.engine.tokenizer.encode(text)
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        for s in tqdm(range(0, len(ids), 8192), desc="moments", unit="seq", disable=quiet):
            if len(ids[s:s + 8192]) > 1:
                llm.generate(prompt_token_ids=[ids[s:s + 8192]], sampling_params=sp)
    finally:
        for h in hooks:
            h.remove()
    n = st["n"]
    mean = st["ksum"] / n
    return {"n": n, "kmean": mean, "kcov": st["kk"] / n - torch.einsum("lhd,lhe->lhde", mean, mean),
            "qq": st["qq"] / n}


def capture(llm, docs, quiet: bool) -> list[dict]:
    """Dense teacher forcing of each lookup doc; q of every decode step and the final keys per layer."""
    from tqdm import tqdm
    from sketchkv.layers.attention import Attention
    from sketchkv.ops.paged_attention import gather_kv
    layers = attention_layers(llm)
    index = {id(m): j for j, m in enumerate(layers)}
    cur = {}
    orig = Attention.decode

    def decode(self, q, block_tables, seq_lens, sparse, graph, max_seq_len):
        j = index.get(id(self))
        if j is not None and q.shape[0] == 1:
            n = int(seq_lens[0])
            cur.setdefault("q", {}).setdefault(j, []).append((q[0].float().clone(), n))
            cur.setdefault("k", {})[j] = gather_kv(self.k_cache, self.v_cache, block_tables[0], n)[0].float().clone()
        return orig(self, q, block_tables, seq_lens, sparse, graph, max_seq_len)

    out = []
    Attention.decode = decode
    try:
        for d in tqdm(docs, desc="capture (dense teacher forcing)", unit="doc", disable=quiet):
            cur.clear()
            ids, k0, k1 = d["ids"], d["k0"], d["k1"]
            rows = llm.teacher_force([ids[:k0 - 1]], [ids[k0 - 1:k1]])[0][1:]
            pred = rows.argmax(-1).tolist()
            steps = k1 - k0  # decode steps whose output predicts an answer token
            out.append({"length": d["length"], "i": d["i"], "tokens": len(ids), "meta": d["meta"],
                        "dense_exact": pred == ids[k0:k1],
                        "q": {j: torch.stack([x[0] for x in v[:steps]]) for j, v in cur["q"].items()},
                        "n": {j: [x[1] for x in v[:steps]] for j, v in cur["q"].items()},
                        "k": dict(cur["k"])})
    finally:
        Attention.decode = orig
    return out


# ----------------------------------------------------------------------------------------------------------
# Bases
# ----------------------------------------------------------------------------------------------------------
def pca_basis(mom, r):
    """The shipped method: top-r eigenvectors of the key covariance; queries use the same basis."""
    evals, evecs = torch.linalg.eigh(mom["kcov"])
    P = evecs.flip(-1)[..., :r].float()
    return {"kb": P, "qb": P, "mean": mom["kmean"].float()}


def uncentered_basis(mom, r):
    """No mean-centering: top-r eigenvectors of E[k k^T], raw keys projected (mean 0)."""
    second = mom["kcov"] + torch.einsum("lhd,lhe->lhde", mom["kmean"], mom["kmean"])
    evals, evecs = torch.linalg.eigh(second)
    P = evecs.flip(-1)[..., :r].float()
    return {"kb": P, "qb": P, "mean": torch.zeros_like(mom["kmean"]).float()}


def qk_basis(mom, r, eps=1e-6):
    """Query-aware asymmetric basis: best rank-r approximation (in expected squared score error over
    calibration queries and keys) of the bilinear form q^T (k - mu): whiten queries by E[qq^T] = Lq Lq^T and
    keys by Cov(k) = Lk Lk^T, SVD of Lq^T Lk = U S V^T; key sketch V_r^T Lk^-1 (k - mu) scaled by S_r
    (the key side carries the variance, as in PCA), query side U_r^T Lq^-1 q."""
    kb, qb = query_aware_basis(mom["kcov"], mom["qq"], r, eps)
    return {"kb": kb.float(), "qb": qb.float(), "mean": mom["kmean"].float()}


def query_aware_basis(kcov: torch.Tensor, qq: torch.Tensor, rank: int, eps: float = 1e-6):
    """kcov, qq [..., D, D] -> (Bk, Bq) [..., D, r] fp64 with q^T (k - mu) ~ (Bq^T q) . (Bk^T (k - mu)):
    Bk = Lk^-T V_r S_r, Bq = Lq^-T U_r where E[q q^T] = Lq Lq^T, Cov(k) = Lk Lk^T, Lq^T Lk = U S V^T."""
    D = kcov.shape[-1]
    eye = torch.eye(D, dtype=torch.float64)

    def chol(c):
        c = c.double()
        jitter = eps * torch.diagonal(c, dim1=-2, dim2=-1).mean(-1)[..., None, None].clamp_min(1e-30)
        return torch.linalg.cholesky(c + jitter * eye)

    lq, lk = chol(qq), chol(kcov)
    u, s, vh = torch.linalg.svd(lq.mT @ lk)
    bk = torch.linalg.solve_triangular(lk.mT, vh.mT[..., :rank] * s[..., None, :rank], upper=True)
    bq = torch.linalg.solve_triangular(lq.mT, u[..., :rank], upper=True)
    return bk, bq


def file_basis(path):
    from sketchkv.kv.basis import KeyBasis
    b = KeyBasis.load(path)
    return {"kb": b.bases.float(), "qb": b.bases.float(), "mean": b.means.float()}


# ----------------------------------------------------------------------------------------------------------
# Replay
# ----------------------------------------------------------------------------------------------------------
def sketch_scores(basis, li, q, K, quant):
    """Approximate per-query-head scores [Hq, n] of the keys K [n, H, D] (n = the step's length)."""
    from sketchkv.ops.sketch import dequantize_int4, quantize_int4
    H = K.shape[1]
    G = q.shape[0] // H
    if basis is None:  # exact
        return torch.einsum("hgd,nhd->hgn", q.view(H, G, -1), K).reshape(H * G, -1)
    y = torch.einsum("nhd,hdr->nhr", K - basis["mean"][li], basis["kb"][li])
    if quant:
        y = dequantize_int4(*quantize_int4(y))
    x = torch.einsum("hgd,hdr->hgr", q.view(H, G, -1), basis["qb"][li])
    return torch.einsum("hgr,nhr->hgn", x, y).reshape(H * G, -1)


def pick(scores, combine, shared, H, lo, hi, k, scale):
    """-> picked positions per KV head: list of H LongTensors (shared: the same one), within [lo, hi)."""
    Hq, n = scores.shape
    G = Hq // H
    s = scores[:, lo:hi]
    if combine == "sum":
        per = s.view(H, G, -1).sum(1)
        agg = per.sum(0, keepdim=True) if shared else per
    elif combine == "max":
        per = s.view(H, G, -1).amax(1)
        agg = per.amax(0, keepdim=True) if shared else per
    elif combine == "softmax":
        per = torch.softmax(s * scale, -1).view(H, G, -1).sum(1)
        agg = per.sum(0, keepdim=True) if shared else per
    else:
        raise ValueError(combine)
    kk = min(k, hi - lo)
    idx = torch.topk(agg, kk, -1).indices + lo
    return [idx[0]] * H if shared else [idx[h] for h in range(H)]


def dense_probs(q, K, n, sinks, recent, scale):
    """Dense attention per query head at a step of length n: probs [Hq, n], candidate range [lo, hi), the
    mass outside sinks+recent per head and each head's most-attended candidate token."""
    H = K.shape[1]
    G = q.shape[0] // H
    logits = torch.einsum("hgd,nhd->hgn", q.view(H, G, -1), K[:n]).reshape(H * G, n) * scale
    p = torch.softmax(logits, -1)
    lo, hi = min(sinks, n), max(min(sinks, n), n - recent)
    pc = p[:, lo:hi]
    return {"p": p, "lo": lo, "hi": hi, "cand_mass": pc.sum(-1), "top": pc.argmax(-1) + lo,
            "top_p": pc.max(-1).values, "G": G}


def step_metrics(d, picks):
    """Dense attention per query head vs the selected set (picks: positions in [lo, hi) per KV head)."""
    mass, cand, top1, top1s = [], [], [], []
    p, G = d["p"], d["G"]
    always = 1.0 - d["cand_mass"]
    for h in range(p.shape[0]):
        pk = picks[h // G]
        got = float(p[h, pk].sum())
        cm = float(d["cand_mass"][h])
        mass.append(float(always[h]) + got)
        cand.append(got / cm if cm > 0 else 1.0)
        hit = bool((pk == d["top"][h]).any())
        top1.append(hit)
        if float(d["top_p"][h]) >= 0.05:
            top1s.append(hit)
    return mass, cand, top1, top1s


def replay(caps, bases, k_ratios, sinks, recent_ratio, quiet):
    from tqdm import tqdm
    variants = []
    for bname, b in bases.items():
        for quant in ([False] if b is None else [True, False]):
            for combine in ("sum", "max", "softmax"):
                for shared in (True, False):
                    variants.append((bname, quant, combine, shared))
    acc = {}
    work = [(c, j) for c in caps for j in c["q"]]
    for c, j in tqdm(work, desc="replay", unit="doc-layer", disable=quiet):
        K = c["k"][j]
        H = K.shape[1]
        scale = 1.0 / math.sqrt(K.shape[-1])
        L = c["length"]
        recent = max(16, round(L * recent_ratio))
        for s, n in enumerate(c["n"][j]):
            q = c["q"][j][s]
            Kn = K[:n]
            d = dense_probs(q, K, n, sinks, recent, scale)
            lo, hi = d["lo"], d["hi"]
            cache = {}
            for (bname, quant, combine, shared) in variants:
                key = (bname, quant)
                if key not in cache:
                    cache[key] = sketch_scores(bases[bname], j, q, Kn, quant)
                for kr in k_ratios:
                    k = max(16, round(L * kr))
                    picks = pick(cache[key], combine, shared, H, lo, hi, k, scale)
                    m = step_metrics(d, picks)
                    a = acc.setdefault((bname, quant, combine, shared, kr, L), {"mass": [], "cand": [], "top1": [],
                                                                                "top1s": []})
                    for name, v in zip(("mass", "cand", "top1", "top1s"), m):
                        a[name] += v
    rows = []
    for (bname, quant, combine, shared, kr, L), a in acc.items():
        rows.append({"basis": bname, "int4": quant, "combine": combine, "shared": shared, "k_ratio": kr,
                     "length": L, "mass": sum(a["mass"]) / len(a["mass"]), "mass_min": min(a["mass"]),
                     "cand": sum(a["cand"]) / len(a["cand"]), "top1": sum(a["top1"]) / len(a["top1"]),
                     "top1s": sum(a["top1s"]) / max(1, len(a["top1s"])), "top1s_n": len(a["top1s"]),
                     "events": len(a["mass"])})
    return rows


# ----------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------
def vname(r):
    q = "int4" if r["int4"] else "fp"
    return f"{r['basis']}/{q}/{r['combine']}/{'shared' if r['shared'] else 'per-kv'}"


KEY_VARIANTS = [  # (variant, what it shows)
    ("pca16/int4/sum/shared", "engine default before this study (shipped rank-16 basis method)"),
    ("file/int4/sum/shared", "the shipped key_basis.safetensors itself"),
    ("pca16/fp/sum/shared", "no int4: quantisation error"),
    ("unc16/int4/sum/shared", "no mean-centering (PCA of raw keys)"),
    ("pca16/int4/sum/per-kv", "per-KV-head picks"),
    ("pca16/int4/max/shared", "max over query heads"),
    ("pca16/int4/softmax/shared", "softmax combine"),
    ("pca16/int4/softmax/per-kv", "softmax combine, per-KV-head picks"),
    ("qk16/int4/softmax/shared", "query-aware basis, rank 16"),
    ("pca32/int4/sum/shared", "rank 32"),
    ("qk32/int4/softmax/shared", "query-aware basis, rank 32, softmax"),
    ("pca32/int4/softmax/shared", "rank 32 + softmax combine (new default)"),
    ("pca32/int4/softmax/per-kv", "rank 32 + softmax, per-KV-head picks"),
    ("unc32/int4/softmax/shared", "rank 32 + softmax, no mean-centering"),
    ("pca64/int4/softmax/shared", "rank 64 (= head_dim) + softmax"),
    ("exact/fp/sum/shared", "exact q.k scores, sum combine"),
    ("exact/fp/softmax/shared", "exact q.k scores, softmax combine"),
    ("exact/fp/softmax/per-kv", "exact scores, softmax, per-KV-head (oracle-like)"),
]


def markdown(res) -> str:
    s = res["settings"]
    Ls, krs = s["lengths"], s["k_ratios"]
    rows = res["rows"]
    get = {(vname(r), r["k_ratio"], r["length"]): r for r in rows}
    lines = ["# Sketch selection study (CPU)", "",
             f"- command: `{res['command']}`", f"- date {res['date']}; {res['cpu']}; torch {res['torch']}",
             f"- model {res['model']}; {s['samples']} lookup documents per length (eval recall generators, seed "
             f"{s['seed']}); dense lookup exact {res['dense_exact']}",
             f"- sinks {s['sinks']}, recent = context x {s['recent_ratio']:.4f}, top_k = context x k_ratio; bases "
             f"fitted from moments over {res['moments_tokens']} calibration tokens (`file`: {res.get('basis_file')})",
             "- variant = basis/scores/combine/picks. `top1@5%`: the most-attended token outside sinks+recent is "
             "picked, over the (step, layer, query head) events putting >= 5% of their mass on it (the retrieval "
             "events); `cand`: share of the dense attention mass outside sinks+recent that the picks cover (mean "
             "over answer steps x layers x query heads); `mass min`: the worst total mass in the attended rows", ""]
    for kr in krs:
        lines += [f"## top_k = {kr:.2%} of context (top1@5% / cand)", "",
                  "| variant | " + " | ".join(C.fmt_len(L) for L in Ls) + " | mass min | what it shows |",
                  "|---|" + "---:|" * len(Ls) + "---:|---|"]
        for v, note in KEY_VARIANTS:
            if not all((v, kr, L) in get for L in Ls):
                continue
            cells = [f"{get[(v, kr, L)]['top1s']:.2f} / {get[(v, kr, L)]['cand']:.3f}" for L in Ls]
            mm = min(get[(v, kr, L)]["mass_min"] for L in Ls)
            lines.append(f"| {v} | " + " | ".join(cells) + f" | {mm:.3f} | {note} |")
        n_ev = {C.fmt_len(L): get[(KEY_VARIANTS[0][0], kr, L)]["top1s_n"] for L in Ls
                if (KEY_VARIANTS[0][0], kr, L) in get}
        lines += ["", f"Retrieval events per length: {n_ev}.", ""]
    kr = krs[len(krs) // 2]
    variants = sorted({vname(r) for r in rows})
    order = sorted(variants, key=lambda v: (-sum(get[(v, kr, L)]["top1s"] for L in Ls),
                                            -sum(get[(v, kr, L)]["cand"] for L in Ls)))
    lines += [f"## Every variant at top_k = {kr:.2%}, best first (top1@5% / cand)", "",
              "| variant | " + " | ".join(C.fmt_len(L) for L in Ls) + " |", "|---|" + "---:|" * len(Ls)]
    for v in order:
        lines.append(f"| {v} | " + " | ".join(f"{get[(v, kr, L)]['top1s']:.2f} / {get[(v, kr, L)]['cand']:.3f}"
                                             for L in Ls) + " |")
    lines.append("")
    return "\n".join(lines)


def plot(res, path):
    plt = C.pyplot()
    s = res["settings"]
    Ls = s["lengths"]
    L = Ls[-1]
    sel = res.get("plot_variants") or []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    get = {(vname(r), r["k_ratio"], r["length"]): r for r in res["rows"]}
    for v in sel:
        xs = [kr for kr in s["k_ratios"] if (v, kr, L) in get]
        for ax, key in zip(axes, ("cand", "top1s")):
            ax.plot(xs, [get[(v, kr, L)][key] for kr in xs], marker="o", label=v)
    for ax, t in zip(axes, ("attention mass outside sinks+recent covered by picks", "top-1 retrieval token picked")):
        ax.set_xscale("log")
        ax.set_xlabel("top_k / context")
        ax.set_title(f"{t} ({C.fmt_len(L)})", fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        base = args.from_json[:-5]
        plot(res, base + ".png")
        with open(base + "-tables.md", "w") as f:
            f.write(markdown(res) + f"\n![selection study]({os.path.basename(base)}.png)\n")
        return
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.set_grad_enabled(False)
    from sketchkv.eval.recall import build_documents, heldout_docs
    model, max_pos = C.resolve_model(args.model)
    tok = C.load_tokenizer(model)
    docs, _ = C.load_documents([], model)
    hd = heldout_docs(tok, docs)
    documents = [d for d in build_documents(tok, hd, sorted(args.lengths), ["lookup"], args.samples, 8, args.seed,
                                            max_pos) if "ids" in d]
    llm = None
    mom_path = os.path.join(args.cache_dir, f"moments-{args.calib_tokens}.pt")
    if os.path.exists(mom_path):
        mom = torch.load(mom_path)
    else:
        llm = C.make_llm(model, {"device": "cpu", "enable_prefix_caching": False, "max_model_len": 8200})
        mom = collect_moments(llm, args.calib_tokens, args.quiet)
        torch.save(mom, mom_path)
        C.release(llm)
        llm = None
    caps = []
    need = []
    for d in documents:
        f = os.path.join(args.cache_dir, f"cap-{args.seed}-{d['length']}-{d['i']}.pt")
        if os.path.exists(f):
            caps.append(torch.load(f))
        else:
            need.append((d, f))
    if need:
        llm = C.make_llm(model, {"device": "cpu", "enable_prefix_caching": False,
                                 "max_model_len": max(len(d["ids"]) for d, _ in need) + 8})
        for d, f in need:
            c = capture(llm, [d], args.quiet)[0]
            torch.save(c, f)
            caps.append(c)
        C.release(llm)
    bases = {"exact": None}
    for r in args.ranks:
        bases[f"pca{r}"] = pca_basis(mom, r)
        if r <= 32:
            bases[f"unc{r}"] = uncentered_basis(mom, r)
        if r < caps[0]["k"][0].shape[-1]:
            bases[f"qk{r}"] = qk_basis(mom, r)
    if args.basis:
        bases["file"] = file_basis(args.basis)
    rows = replay(caps, bases, args.k_ratios, args.sinks, args.recent_ratio, args.quiet)
    import platform
    res = {"command": "python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": f"{platform.processor() or platform.machine()}, "
           f"{torch.get_num_threads()} threads", "torch": torch.__version__, "model": args.model,
           "moments_tokens": mom["n"],
           "dense_exact": {C.fmt_len(L): f"{sum(c['dense_exact'] for c in caps if c['length'] == L)}/"
                                         f"{sum(1 for c in caps if c['length'] == L)}" for L in sorted(args.lengths)},
           "settings": {"lengths": sorted(args.lengths), "samples": args.samples, "k_ratios": args.k_ratios,
                        "sinks": args.sinks, "recent_ratio": args.recent_ratio, "seed": args.seed,
                        "ranks": args.ranks},
           "basis_file": args.basis,
           "plot_variants": ["pca16/int4/sum/shared", "pca16/int4/softmax/shared", "pca32/int4/sum/shared",
                             "pca32/int4/softmax/shared", "pca32/int4/softmax/per-kv", "qk32/int4/softmax/shared",
                             "exact/fp/sum/shared", "exact/fp/softmax/per-kv"],
           "rows": rows, "seconds": round(time.time() - t0, 1)}
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, args.name)
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, base + ".png")
    with open(base + "-tables.md", "w") as f:  # NAME.md is left for the written report
        f.write(markdown(res) + f"\n![selection study]({os.path.basename(base)}.png)\n")
    print(f"wrote {base}-tables.md, {base}.json, {base}.png in {res['seconds']} s")


if __name__ == "__main__":
    main()
