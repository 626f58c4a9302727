"""Per-layer selection diagnostics on the dense teacher-forced trajectory of one sample.
Records q,k,v of every full-attention layer, then for each decode step and layer scores policies:
missed attention mass per query head and relative error of the attention output."""
import sys, os, time, json
import torch
torch.set_num_threads(int(os.environ.get("THREADS", 1)))
sys.modules.setdefault("fla", None)
from sketchkv.llm import LLM
from sketchkv.eval import common as C
from sketchkv.eval.kld import token_stream, make_samples
from sketchkv.ops.sketch import sketch_keys_ref, dequantize_int4, combine_heads
from sketchkv.ops.topk import topk_positions_torch
from sketchkv.kv.basis import KeyBasis

MODEL = "/tmp/q40/smol-hf"
L = int(os.environ.get("LEN", 2048)); CONT = int(os.environ.get("CONT", 64)); NS = int(os.environ.get("NS", 1))
S_, R_ = 16, 64
data = os.environ.get("DATA", "/root/.pyenv/versions/3.11.7/lib/python3.11/asyncio").split(",")
llm = LLM(MODEL, device="cpu", dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=8192)
tok = C.load_tokenizer(MODEL)
docs = C.read_documents(data)
ids, starts = token_stream(tok, docs)
samples = make_samples(ids, starts, [L], CONT, NS, 0, 8192)
layers = llm.engine.runner.attn_layers
rec = {}
for j, m in enumerate(layers):
    orig = m.forward
    def f(q, k, v, j=j, orig=orig):
        r = rec.setdefault(j, {"q": [], "k": [], "v": []})
        r["q"].append(q.detach().clone()); r["k"].append(k.detach().clone()); r["v"].append(v.detach().clone())
        return orig(q, k, v)
    m.forward = f
basis = KeyBasis.load(os.environ.get("BASIS", "/tmp/q40/basis64.safetensors"))
Hq, Hkv, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
G = Hq // Hkv; scale = layers[0].scale

def policies():
    for k in (64, 128):
        yield f"oracle-shared-k{k}", ("exact", True, k, None)
        yield f"oracle-kvhead-k{k}", ("exact", False, k, None)
    yield "oracle-qhead-k64", ("qhead", False, 64, None)
    for r in (16, 32, 64):
        for k in (64,):
            yield f"sketch{r}-shared-k{k}", ("sketch", True, k, r)
            yield f"sketch{r}-kvhead-k{k}", ("sketch", False, k, r)
    yield "recent-only", ("none", True, 0, None)

res = {}
t0 = time.time()
for s in samples:
    rec.clear()
    llm.teacher_force([s["prompt"]], [s["cont"]])
    P = s["prompt_len"]
    print(f"teacher-forced {time.time()-t0:.0f}s", flush=True)
    for j in range(len(layers)):
        print(f"layer {j} {time.time()-t0:.0f}s", flush=True)
        r = rec[j]
        Q = torch.cat(r["q"]).float(); K = torch.cat(r["k"]).float(); V = torch.cat(r["v"]).float()
        n_all = K.shape[0]
        sk = {}
        for rr in (16, 32, 64):
            B = basis.bases[j][..., :rr]; M = basis.means[j]
            pk, sc = sketch_keys_ref(K, M, B)
            sk[rr] = (B, dequantize_int4(pk, sc))
        for step in range(1, CONT):          # scored decode rows: positions P+1 .. (row 0 is the prefill's)
            p = P + step                      # query position; context n = p + 1
            n = p + 1
            q = Q[p].view(Hkv, G, D)
            Kc, Vc = K[:n], V[:n]
            logits = torch.einsum("hgd,thd->hgt", q, Kc) * scale
            prob = logits.softmax(-1)                                  # [Hkv, G, n]
            o = torch.einsum("hgt,thd->hgd", prob, Vc)
            cand = torch.zeros(n, dtype=torch.bool); cand[S_:n - R_] = True
            base = ~cand
            for name, (kind, shared, k, rr) in policies():
                if kind == "none":
                    sel = base.expand(Hkv, G, n)
                else:
                    if kind == "sketch":
                        Bm, skd = sk[rr]
                        qp = torch.einsum("hgd,hdr->hgr", q, Bm)
                        per_q = torch.einsum("hgr,thr->hgt", qp, skd[:n])
                    else:
                        per_q = torch.einsum("hgd,thd->hgt", q, Kc)
                    per_q = per_q.masked_fill(~cand, float("-inf"))[None]
                    if kind == "qhead":
                        sc_ = (per_q[0] * scale)                      # [Hkv, G, n] per query head
                        picks = topk_positions_torch(sc_, min(k, int(cand.sum())), -1)
                        sel = base.expand(Hkv, G, n).clone()
                        for h in range(Hkv):
                            for g in range(G):
                                pp = picks[h, g]; sel[h, g, pp[pp >= 0].long()] = True
                    else:
                        sc_ = combine_heads(per_q, shared, "softmax", scale)[0]  # [1 or Hkv, n]
                        picks = topk_positions_torch(sc_, min(k, int(cand.sum())), -1)
                        selh = base.expand(sc_.shape[0], n).clone()
                        for h in range(sc_.shape[0]):
                            pp = picks[h]; selh[h, pp[pp >= 0].long()] = True
                        sel = selh[:, None, :].expand(Hkv, G, n)
                        if kind == "sketch":   # part 5: the candidates' sketch-estimated mass the picks miss
                            cm = sc_.logsumexp(-1)
                            pm = torch.stack([sc_[h, picks[h][picks[h] >= 0].long()].logsumexp(-1) for h in range(sc_.shape[0])])
                            est = float((1 - (pm - cm).exp()).mean())
                miss = 1 - (prob * sel).sum(-1)                         # [Hkv, G]
                lg = logits.masked_fill(~sel, float("-inf"))
                os_ = torch.einsum("hgt,thd->hgd", lg.softmax(-1), Vc)
                err = (os_ - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-9)
                d = res.setdefault(name, {"miss": torch.zeros(len(layers), Hkv, G), "err": torch.zeros(len(layers), Hkv, G), "n": 0})
                d["miss"][j] += miss; d["err"][j] += err
                if kind == "sketch":
                    d.setdefault("pairs", []).append((j, step, est, float(miss.mean()), float(err.mean())))
                if j == 0: d["n"] += 1
    print(f"sample done {time.time()-t0:.0f}s", flush=True)
out = {}
for name, d in res.items():
    m = d["miss"] / d["n"]; e = d["err"] / d["n"]
    out.setdefault("_pairs", {})[name] = d.get("pairs", [])
    out[name] = {"miss_layer": m.mean((1, 2)).tolist(), "err_layer": e.mean((1, 2)).tolist(),
                 "miss_head": m.tolist(), "err_head": e.tolist()}
json.dump(out, open(os.environ.get("OUT", "/tmp/q40/localize.json"), "w"))
print(f"{'policy':24s} {'miss':>7s} {'err':>7s}  miss by layer (first 6 | max)")
for name, d in out.items():
    if name.startswith("_"): continue
    ml, el = d["miss_layer"], d["err_layer"]
    print(f"{name:24s} {sum(ml)/len(ml):7.4f} {sum(el)/len(el):7.4f}  " + " ".join(f"{x:.3f}" for x in ml[:6]) + f" | max {max(ml):.3f}@{ml.index(max(ml))}")
