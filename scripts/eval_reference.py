#!/usr/bin/env python3
"""Evaluate the sketchkv reference model (project issue 3) and write its report.

    python scripts/eval_reference.py DIR [--eval-samples 20 ...]      # same as train_reference.py --eval-only DIR

Through transformers (AutoModelForCausalLM, SDPA, bf16 on GPU; Gated DeltaNet through fla on GPU):

* held-out perplexity and bits per byte: windows of --eval-ppl-seq tokens spread evenly over the held-out packages
  (listed in DIR/heldout.json); also the loss by position inside the window, and top-1 accuracy of the main head
  (t+1) and of the MTP head (t+2) on the same windows;
* dense recall at each length of --eval-lengths, --eval-samples documents each, built from held-out code:
  - lookup: a REGISTRY dict of --eval-registry random `"k_xxxx": 0xhhhhhh` entries inserted at 1-5% depth, and at the
    very end `assert REGISTRY["k_xxxx"] ==`; the model must produce the value;
  - copy: a held-out function inserted at 1-5% depth and repeated at the end; given its signature line the model
    must produce its body.
  Exact match is greedy exact match, computed by teacher forcing: greedy decoding reproduces the answer iff the
  argmax at every answer position, given the true prefix, is the answer token (one forward per document; no cache
  needed; at 256K a single bf16 forward with SDPA/flash and fla fits easily on an H200). --eval-generate-check
  runs real greedy generation through transformers' cache (`model.generate`, DynamicCache) on the first samples of
  the shortest length and on one sample of the longest length, to confirm the equivalence and the cache path.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import random
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if REPO not in sys.path:  # the sketchkv package of this checkout
    sys.path.insert(0, REPO)
from sketchkv.eval.common import answer_span  # noqa: E402


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def load_model(ckpt_dir, device):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    import reference_common as rc
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, info = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=dtype, attn_implementation="sdpa",
                                                       output_loading_info=True)
    model = model.to(device).eval()
    sd = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    mtp = rc.make_mtp(model.config)
    msd = {k[4:]: v.to(dtype) for k, v in sd.items() if k.startswith("mtp.")}
    mtp_missing = None
    if msd:
        res = mtp.load_state_dict(msd, strict=False)
        mtp_missing = list(res.missing_keys) + list(res.unexpected_keys)
        mtp = mtp.to(device=device, dtype=dtype).eval()
    else:
        mtp = None
    load_info = {k: sorted(v) if isinstance(v, (list, set)) else str(v) for k, v in info.items()
                 if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    load_info["unexpected_non_mtp"] = [k for k in load_info.get("unexpected_keys", []) if not k.startswith("mtp.")]
    load_info["unexpected_keys"] = f"{len(load_info.get('unexpected_keys', []))} keys (mtp.* are expected here)"
    load_info["mtp_state_problems"] = mtp_missing
    return model, mtp, load_info


def teacher_forced(model, ids, k0: int, k1: int, device):
    """Greedy predictions for answer tokens ids[k0:k1] given the true prefix; one forward."""
    import torch
    x = torch.tensor([ids[:k1 - 1]], device=device)
    with torch.inference_mode():
        h = model.model(input_ids=x, use_cache=False).last_hidden_state[0, k0 - 1:k1 - 1]
        pred = model.lm_head(h).argmax(-1).tolist()
    return pred


def greedy_generate(model, ids, k0: int, n_new: int, device):
    import torch
    x = torch.tensor([ids[:k0]], device=device)
    with torch.inference_mode():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, k0:].tolist()


def heldout_ppl(model, mtp, ids, nbytes, seq: int, max_tokens: int, device) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import reference_common as rc
    n_win = max(1, min(max_tokens // seq, len(ids) // (seq + 1)))
    if len(ids) < seq + 1:
        seq = len(ids) - 1
    starts = np.linspace(0, len(ids) - seq - 1, n_win).astype(np.int64)
    buckets = [(0, 128), (128, 1024), (1024, 4096), (4096, 16384), (16384, 1 << 30)]
    b_sum = [0.0] * len(buckets)
    b_cnt = [0] * len(buckets)
    tot_nll, tot_tok, tot_bytes, top1, mtp_top1, mtp_n, mtp_nll = 0.0, 0, 0, 0, 0, 0, 0.0
    for s in starts:
        w = torch.from_numpy(np.asarray(ids[s:s + seq + 1], dtype=np.int64)).to(device)
        x, y = w[None, :-1], w[None, 1:]
        with torch.inference_mode():
            h = model.model(input_ids=x, use_cache=False).last_hidden_state
            nll = torch.empty(seq, device=device)
            pred = torch.empty(seq, dtype=torch.long, device=device)
            for c in range(0, seq, 4096):
                lg = model.lm_head(h[0, c:c + 4096]).float()
                nll[c:c + 4096] = F.cross_entropy(lg, y[0, c:c + 4096], reduction="none")
                pred[c:c + 4096] = lg.argmax(-1)
            if mtp is not None:
                mlog = rc.mtp_forward(model, mtp, x, h)[0]  # (seq-1, V): predicts y[t+1] = token t+2
                for c in range(0, seq - 1, 4096):
                    e = min(c + 4096, seq - 1)
                    lg = mlog[c:e].float()
                    tgt = y[0, c + 1:e + 1]
                    mtp_nll += float(F.cross_entropy(lg, tgt, reduction="sum"))
                    mtp_top1 += int((lg.argmax(-1) == tgt).sum())
                    mtp_n += e - c
                del mlog
        nll_c = nll.double().cpu().numpy()
        tot_nll += float(nll_c.sum())
        tot_tok += seq
        tot_bytes += int(nbytes[np.asarray(ids[s + 1:s + seq + 1])].sum())
        top1 += int((pred == y[0]).sum())
        for i, (a, b) in enumerate(buckets):
            if a < seq:
                b_sum[i] += float(nll_c[a:min(b, seq)].sum())
                b_cnt[i] += min(b, seq) - a
    out = {
        "tokens": tot_tok, "windows": int(n_win), "window": seq, "bytes": tot_bytes,
        "nll_per_token": tot_nll / tot_tok, "ppl": math.exp(tot_nll / tot_tok),
        "bits_per_byte": tot_nll / math.log(2) / max(tot_bytes, 1), "bytes_per_token": tot_bytes / tot_tok,
        "top1_next_token": top1 / tot_tok,
        "loss_by_position": {f"{a}-{min(b, seq)}": b_sum[i] / b_cnt[i] for i, (a, b) in enumerate(buckets)
                             if b_cnt[i] > 0},
    }
    if mtp_n:
        out["mtp_top1_t_plus_2"] = mtp_top1 / mtp_n
        out["mtp_nll_t_plus_2"] = mtp_nll / mtp_n
    return out


def _build_doc(tok, docs, kind, length, i, seed, n_entries):
    rng = random.Random(f"{seed}-{kind}-{length}-{i}")
    doc = docs.lookup_doc(rng, length, n_entries) if kind == "lookup" else docs.copy_doc(rng, length)
    enc = tok.encode(doc.text, add_special_tokens=False)
    k0, k1 = answer_span(enc.offsets, doc.answer_start, doc.answer_end)
    return enc.ids, k0, k1


def recall(model, tok, docs, lengths, samples, n_entries, seed, device, deadline, gen_check, workers=4) -> dict:
    """Greedy exact match / token accuracy of lookup and copy documents at each length. Documents are built and
    tokenized by a few threads ahead of the GPU (the tokenizer releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    jobs = [(length, kind, i) for length in lengths for kind in ("lookup", "copy") for i in range(samples)]
    results, gen_checks = {}, []
    t_start = time.time()
    acc: dict = {}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        pending = {}
        lookahead = 2 * max(1, workers)
        nxt = 0
        for j, (length, kind, i) in enumerate(jobs):
            while nxt < len(jobs) and nxt < j + lookahead:
                L_, k_, i_ = jobs[nxt]
                pending[nxt] = pool.submit(_build_doc, tok, docs, k_, L_, i_, seed, n_entries)
                nxt += 1
            fut = pending.pop(j)
            key = (length, kind)
            r = acc.setdefault(key, {"exact": 0, "tok_acc": 0.0, "n_tokens": 0, "doc_lens": [], "n": 0,
                                     "t0": time.time(), "skipped": 0})
            ids = None
            if deadline is not None and time.time() > deadline:
                r["skipped"] += 1
                fut.cancel()
            else:
                try:
                    ids, k0, k1 = fut.result()
                except RuntimeError as e:  # e.g. no held-out function short enough for this length
                    r["skipped"] += 1
                    r.setdefault("errors", []).append(str(e)[:200])
                    ids = None
            if ids is not None and deadline is not None and time.time() > deadline:
                r["skipped"] += 1
                ids = None
            if ids is not None:
                pred = teacher_forced(model, ids, k0, k1, device)
                target = ids[k0:k1]
                hit = pred == target
                r["exact"] += int(hit)
                r["tok_acc"] += sum(int(p == t) for p, t in zip(pred, target)) / len(target)
                r["n_tokens"] += len(target)
                r["doc_lens"].append(len(ids))
                r["n"] += 1
                if (length == lengths[0] and i < gen_check) or (length == lengths[-1] and len(lengths) > 1
                                                                 and i < min(gen_check, 1)):
                    try:
                        gen = greedy_generate(model, ids, k0, len(target), device)
                        # greedy decoding leaves the answer exactly where the teacher-forced argmax first misses it,
                        # with the same token: compare the first miss and the token produced there
                        e_tf = next((q for q, (p_, t_) in enumerate(zip(pred, target)) if p_ != t_), None)
                        e_gen = next((q for q, (g_, t_) in enumerate(zip(gen, target)) if g_ != t_), None)
                        agree = e_tf == e_gen and (e_tf is None or gen[e_tf] == pred[e_tf])
                        gen_checks.append({"kind": kind, "length": length, "sample": i, "teacher_forced_exact": hit,
                                           "generate_exact": gen == target, "first_miss_teacher_forced": e_tf,
                                           "first_miss_generate": e_gen, "agree": agree})
                    except Exception as e:  # record, never fail the evaluation on this
                        gen_checks.append({"kind": kind, "length": length, "sample": i,
                                           "error": f"{type(e).__name__}: {e}"[:300]})
            if i == samples - 1:
                n = r["n"]
                res = {"n": n, "exact": r["exact"] / n if n else None, "token_acc": r["tok_acc"] / n if n else None,
                       "mean_answer_tokens": r["n_tokens"] / n if n else None,
                       "mean_doc_tokens": sum(r["doc_lens"]) / n if n else None,
                       "seconds": round(time.time() - r["t0"], 1), "skipped": r["skipped"]}
                if r.get("errors"):
                    res["errors"] = sorted(set(r["errors"]))
                results.setdefault(str(length), {})[kind] = res
                if n:
                    log(f"recall {kind:6s} @ {length:>6d}: exact {res['exact']:.2f} token acc {res['token_acc']:.3f} "
                        f"(n={n}, ~{res['mean_doc_tokens']:.0f} tokens/doc, {res['seconds']}s)")
                else:
                    log(f"recall {kind:6s} @ {length:>6d}: all {r['skipped']} samples skipped (time budget or "
                        f"{res.get('errors', ['-'])[0]})")
    return {"by_length": results, "generate_check": gen_checks, "seconds": round(time.time() - t_start, 1)}


def evaluate_and_report(args, ckpt_dir, device, corpus_root=None, eval_command=None, deadline=None) -> dict:
    import torch
    import reference_data as rd
    import reference_common as rc
    t0 = time.time()
    with open(os.path.join(ckpt_dir, "trainer_state.json")) as f:
        state = json.load(f)
    with open(os.path.join(ckpt_dir, "heldout.json")) as f:
        heldout = json.load(f)
    gdn_info = rc.install_gdn_dispatch()
    if device.type == "cuda" and "fla." in gdn_info["torch_chunk_gated_delta_rule"]["cuda"]:
        if getattr(args, "fla_autotune", "lite") == "lite":
            rc.prune_fla_autotune(getattr(args, "fla_max_configs", 2))
    tok = rd.load_tokenizer(ckpt_dir)
    nbytes, _ = rd.token_tables(tok)
    model, mtp, load_info = load_model(ckpt_dir, device)
    log(f"loaded {ckpt_dir} with AutoModelForCausalLM ({type(model).__name__}, {model.dtype}, "
        f"attn {model.config._attn_implementation}); missing keys: {load_info.get('missing_keys')}")
    root = corpus_root or heldout["corpus_root"]
    files = [rd.SourceFile(f["path"], f["path"].split(os.sep)[0].split("/")[0], f["bytes"]) for f in heldout["files"]]
    for f in files:
        if f.package.endswith(".py"):
            f.package = f.package[:-3]
    texts = rd.read_files(root, files, 1)  # serial: no fork after CUDA / tokenizer threads started
    if not texts:
        raise SystemExit(f"no held-out files readable under {root}")
    text, starts = rd.heldout_text(files, texts)
    funcs = rd.function_pool(texts, 1, 5000, seed=123)
    ids, tok_starts = rd.encode_with_offsets(tok, text, starts)
    docs = rd.HeldoutDocs(tok, text, starts, funcs, tok_starts=tok_starts)
    log(f"held-out: {len(texts)} files, {len(text) / 1e6:.2f}M chars, {len(ids) / 1e6:.2f}M tokens, "
        f"{len(funcs)} functions for the copy task")
    t_ppl = time.time()
    ppl = heldout_ppl(model, mtp, ids, nbytes, args.eval_ppl_seq, args.eval_ppl_tokens, device)
    log(f"held-out ppl {ppl['ppl']:.3f}  bits/byte {ppl['bits_per_byte']:.4f}  top-1 {ppl['top1_next_token']:.3f}  "
        f"MTP(t+2) top-1 {ppl.get('mtp_top1_t_plus_2', float('nan')):.3f}  ({ppl['tokens']} tokens, "
        f"{time.time() - t_ppl:.1f}s)")
    lengths = [int(x) for x in str(args.eval_lengths).split(",") if x]
    maxpos = model.config.max_position_embeddings
    lengths = [n for n in lengths if n <= maxpos]
    rec = recall(model, tok, docs, lengths, args.eval_samples, args.eval_registry, args.seed, device,
                 None if deadline is None else deadline - 10, args.eval_generate_check,
                 workers=min(8, getattr(args, "workers", 1)))
    results = {
        "checkpoint": os.path.relpath(ckpt_dir, REPO) if ckpt_dir.startswith(REPO) else ckpt_dir,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": rc.versions(), "gdn_kernels_eval": dict(rc.GDN_USED), "load_info": load_info,
        "heldout": {"packages": heldout["packages"], "files": len(texts), "chars": len(text), "tokens": int(len(ids)),
                    "corpus_root": root},
        "perplexity": ppl, "recall": rec, "eval_seconds": round(time.time() - t0, 1),
        "eval_args": {k: getattr(args, k) for k in ("eval_lengths", "eval_samples", "eval_ppl_tokens",
                                                    "eval_ppl_seq", "eval_registry", "seed")},
        "eval_command": eval_command, "training": state,
        "file_bytes": os.path.getsize(os.path.join(ckpt_dir, "model.safetensors")),
        "config": json.load(open(os.path.join(ckpt_dir, "config.json"))),
    }
    print_table(results)
    write_report(results, args.report)
    if getattr(args, "export", None):
        export_artifacts(ckpt_dir, args.report, args.export)
    return results


def export_artifacts(ckpt_dir, report_path, export_dir, part_mb: float = 15.0) -> list[str]:
    """Pack the checkpoint directory into a tar split into parts of at most `part_mb` MiB (the device tool
    brings back files of at most 16 MiB) and copy the report files next to it. Reassemble with
    `cat reference-model.tar.* | tar -x -C sketchkv/assets/`."""
    import io
    import shutil
    import tarfile
    os.makedirs(export_dir, exist_ok=True)
    name = os.path.basename(os.path.normpath(ckpt_dir))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(ckpt_dir, arcname=name)
    data = buf.getvalue()
    step = int(part_mb * 2**20)
    written = []
    for old in os.listdir(export_dir):
        if old.startswith(f"{name}.tar."):
            os.remove(os.path.join(export_dir, old))
    for n, off in enumerate(range(0, len(data), step)):
        path = os.path.join(export_dir, f"{name}.tar.{n:02d}")
        with open(path, "wb") as f:
            f.write(data[off:off + step])
        written.append(path)
    base = os.path.splitext(report_path)[0] if report_path else None
    for ext in (".md", ".png", ".json"):
        if base and os.path.exists(base + ext):
            shutil.copy(base + ext, export_dir)
            written.append(os.path.join(export_dir, os.path.basename(base + ext)))
    log(f"exported {len(written)} files to {export_dir} ({len(data) / 2**20:.1f} MiB checkpoint tar in "
        f"{n + 1} parts); reassemble: cat {name}.tar.* | tar -x -C <parent dir of {name}>")
    return written


def print_table(results) -> None:
    print("\n" + recall_table(results) + "\n", flush=True)


def recall_table(results) -> str:
    rows = ["| context (tokens) | lookup exact | lookup token acc | copy exact | copy token acc | n |",
            "|---:|---:|---:|---:|---:|---:|"]
    for length, r in results["recall"]["by_length"].items():
        lk, cp = r.get("lookup", {}), r.get("copy", {})

        def f(v):
            return "–" if v is None else f"{v:.2f}"
        rows.append(f"| {int(length):,} | {f(lk.get('exact'))} | {f(lk.get('token_acc'))} | {f(cp.get('exact'))} | "
                    f"{f(cp.get('token_acc'))} | {lk.get('n', 0)}/{cp.get('n', 0)} |")
    return "\n".join(rows)


def plot(results, png_path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"matplotlib unavailable ({e}); no PNG written")
        return False
    hist = results["training"].get("history", [])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    ax = axes[0]
    if hist:
        tok = [h["tokens"] / 1e6 for h in hist]
        ax.plot(tok, [h["lm_loss"] for h in hist], label="LM loss (t+1)")
        ax.plot(tok, [h["mtp_loss"] for h in hist], label="MTP loss (t+2)")
        ans = [(t, h["answer_loss"]) for t, h in zip(tok, hist) if h.get("answer_loss") is not None]
        if ans:
            ax.plot([a for a, _ in ans], [b for _, b in ans], ".-", label="retrieval-answer loss", alpha=0.7)
        ax.set_yscale("log")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    by = results["recall"]["by_length"]
    xs = [int(k) for k in by]
    for kind, mk in (("lookup", "o-"), ("copy", "s-")):
        pts = [(x, by[str(x)][kind]["exact"]) for x in xs if by[str(x)].get(kind, {}).get("exact") is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], mk, label=f"{kind} exact match")
    args = results["training"].get("args", {})
    for L, lab in ((args.get("seq_len"), "train seq"), (args.get("long_seq_len") if args.get("long_every") else None,
                                                       "long train seq")):
        if L:
            ax.axvline(L, color="gray", ls="--", alpha=0.6)
            ax.text(L, 0.02, f" {lab}", rotation=90, color="gray", fontsize=8, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("greedy exact match")
    ax.set_title("dense recall on held-out code")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


def write_report(results, report_path) -> None:
    base = os.path.splitext(report_path)[0]
    os.makedirs(os.path.dirname(os.path.abspath(report_path)) or ".", exist_ok=True)
    png = base + ".png"
    have_png = plot(results, png)
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    st = results["training"]
    a = st["args"]
    p = results["perplexity"]
    cfgp = st.get("params", {})
    k = st.get("kernels", {})
    chk = k.get("gdn_check", {})
    layer_types = "".join("A" if t == "full_attention" else "L"
                          for t in results.get("config", {}).get("layer_types", []))
    layer_types = f"{layer_types} (L = Gated DeltaNet, A = gated attention)" if layer_types else "?"
    lines = [
        "# sketchkv reference model: training and evaluation",
        "",
        f"Generated {results['date']} by `scripts/train_reference.py` / `scripts/eval_reference.py` "
        f"(project issue 3). Checkpoint: `{results['checkpoint']}` "
        f"(model.safetensors {results['file_bytes'] / 2**20:.2f} MiB, bf16).",
        "",
        "## Commands",
        "",
        "```",
        *[f"python {c}" if not c.startswith("python") else c for c in st.get("commands", [])],
        *([results["eval_command"]] if results.get("eval_command") else []),
        "```",
        "",
        "## Model",
        "",
        f"`Qwen3_5ForCausalLM` (`qwen3_5_text`): hidden {a['hidden']}, {a['layers']} layers "
        f"(layer_types {layer_types}), "
        f"MLP {a['intermediate']}, attention {a['heads']} q heads / {a['kv_heads']} kv heads x {a['head_dim']} "
        f"(gated, partial rotary {a['partial_rotary']}, rope_theta {a['rope_theta']:g}), Gated DeltaNet "
        f"{a['linear_key_heads']} key heads x {a['linear_key_dim']} / {a['linear_value_heads']} value heads x "
        f"{a['linear_value_dim']}, vocab {results['config'].get('vocab_size')}, tied embeddings, "
        f"max_position_embeddings {a['max_positions']}; one MTP layer (`mtp.*`, predicts t+2; position id of "
        f"(h_t, token_(t+1)) is t).",
        "",
        f"Parameters: main {cfgp.get('main', 0) / 1e6:.2f}M + MTP {cfgp.get('mtp', 0) / 1e6:.2f}M = "
        f"{cfgp.get('total', 0) / 1e6:.2f}M.",
        "",
        "## Training",
        "",
        f"- device {st.get('device')}; versions {st.get('versions')}",
        f"- Gated DeltaNet kernels (training): {st.get('gdn_used')}; attention: SDPA",
        (f"- fla guard bypassed: {chk.get('guard_bypassed')} (guard active: {chk.get('guard_active')}); fla vs fp32 "
         f"PyTorch reference at B=2 T=1024 (fwd + bwd), relative errors: "
         f"{ {n: round(v, 4) for n, v in chk.get('rel_err', {}).items()} } (tolerance {chk.get('tol')})"
         if chk else "- fla not used (no GPU): no guard bypass, no fla gradient check"),
        f"- fla autotune: {k.get('fla_autotune', 'n/a')}",
        f"- data: {st['data'].get('train_tokens', 0) / 1e6:.1f}M tokens of Python from "
        f"{st['data'].get('train_packages')} packages under `{st['data'].get('corpus_root')}` "
        f"({st['data'].get('chars_per_token', 0):.2f} chars/token), packages concatenated file by file; synthetic "
        f"retrieval rows {a['synth_frac']:.0%} (registries/constants asserted later, functions repeated verbatim), "
        f"answer-token loss weight {a['answer_weight']}, MTP loss weight {a['mtp_weight']}",
        f"- held-out packages (never trained on): {results['heldout']['packages']} "
        f"({results['heldout']['files']} files, {results['heldout']['tokens'] / 1e6:.2f}M tokens); list in "
        f"`heldout.json`",
        f"- {st['step']} steps, {st['tokens_seen'] / 1e6:.1f}M tokens, {st['train_seconds'] / 60:.2f} min of training; "
        f"{a['batch_size']} x {a['seq_len']} tokens per step"
        + (f", 1 step in {a['long_every']}: {a['batch_size'] * a['seq_len'] // a['long_seq_len']} x "
           f"{a['long_seq_len']}" if a.get("long_every") else "")
        + f"; AdamW lr {a['lr']} (warmup {a['warmup_steps']}, cosine to {a['min_lr_ratio']}x), betas (0.9, "
          f"{a['beta2']}), wd {a['weight_decay']}, clip {a['grad_clip']}; bf16 autocast, fp32 master weights",
    ]
    if st.get("history"):
        h = st["history"][-1]
        lines.append(f"- last logged: LM loss {h['lm_loss']}, MTP loss {h['mtp_loss']}, answer loss "
                     f"{h['answer_loss']}, {h['tok_per_s'] / 1e3:.0f}K tokens/s")
    lines += [
        f"- time of the last command (s): {st.get('time_this_command_s')}; first step incl. compile "
        f"{round(st.get('first_step_s') or 0, 1)}s; data prep (s) {st['data'].get('timing_s')}",
        "",
        "## Evaluation (held-out packages)",
        "",
        f"- perplexity {p['ppl']:.3f} ({p['nll_per_token']:.4f} nats/token), "
        f"**{p['bits_per_byte']:.4f} bits per byte** "
        f"({p['bytes_per_token']:.2f} bytes/token), top-1 next-token accuracy {p['top1_next_token']:.3f}, over "
        f"{p['tokens']:,} tokens in {p['windows']} windows of {p['window']}",
        "- loss by position in the window (nats/token): "
        + ", ".join(f"{k}: {v:.3f}" for k, v in p["loss_by_position"].items()),
    ]
    if "mtp_top1_t_plus_2" in p:
        lines.append(f"- MTP head (t+2): top-1 accuracy {p['mtp_top1_t_plus_2']:.3f}, loss "
                     f"{p['mtp_nll_t_plus_2']:.3f} nats/token")
    lines += [
        "",
        "Dense recall (greedy exact match, teacher-forced; lookup: REGISTRY of "
        f"{results['eval_args']['eval_registry']} random keys at 1-5% depth, queried at the end; copy: a held-out "
        "function at 1-5% depth repeated at the end, body produced from its signature):",
        "",
        recall_table(results),
        "",
    ]
    gc = results["recall"].get("generate_check", [])
    if gc:
        agree = sum(1 for g in gc if g.get("agree"))
        errs = [g for g in gc if "error" in g]
        lines.append(f"Cached greedy generation (`model.generate`, bf16 on GPU) agreed with the teacher-forced verdict "
                     f"(same first wrong token at the same position, or both exact) on {agree}/{len(gc)} samples"
                     + (f"; errors: {errs[0]['error']}" if errs else "") + ".")
        lines.append("")
    lines.append(f"Loading through `AutoModelForCausalLM.from_pretrained`: {results['load_info']}")
    lines.append("")
    if have_png:
        lines += [f"![loss and recall]({os.path.basename(png)})", ""]
    lines += [f"Evaluation took {results['eval_seconds']:.0f}s on {results['device']}. Raw numbers: "
              f"`{os.path.basename(base)}.json`.", ""]
    with open(report_path, "w") as f:
        f.write("\n".join(lines))
    log(f"report written: {report_path}" + (f", {png}" if have_png else "") + f", {base}.json")


def main_eval_only(args) -> int:
    import torch
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    t0 = time.time()
    ckpt = args.eval_only
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        st = json.load(f)
    if args.corpus_root is None:
        args.corpus_root = st["args"].get("corpus_root")
    cmd = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    evaluate_and_report(args, ckpt, device, corpus_root=args.corpus_root, eval_command=cmd,
                        deadline=t0 + args.wall_minutes * 60 - 5)
    return 0


if __name__ == "__main__":
    import reference_common as rc
    argv = sys.argv[1:]
    if argv and not argv[0].startswith("-"):
        argv = ["--eval-only", argv[0]] + argv[1:]
    cli_args = rc.parse_args(argv, __doc__)
    if not cli_args.eval_only:
        sys.exit("eval_reference.py: give the checkpoint directory: python scripts/eval_reference.py DIR")
    rc.setup_env()
    sys.exit(main_eval_only(cli_args))
