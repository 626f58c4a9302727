#!/usr/bin/env python3
"""Train the sketchkv reference model: a small Qwen3.5-architecture LM (Gated DeltaNet + gated attention, one MTP
layer) on the Python source of a site-packages directory plus synthetic long-range retrieval written as code.
Project issue 3. One command, seeded, time-budgeted, resumable; evaluation runs at the end (or `--eval-only DIR`).

On one H200 (each command fits the 10-minute limit: --wall-minutes 9 caps the whole process, training stops early
enough to save and, unless --no-eval, to evaluate):

    python scripts/train_reference.py --export $OUT                      # prep + train + save + eval

Split over two commands for more training (the second one restores fp32 weights + AdamW from
out/reference-train-state/ if it runs on the same, still warm machine, else it resumes from the bf16 checkpoint
with a fresh AdamW and a short LR re-warmup):

    python scripts/train_reference.py --total-minutes 10 --no-eval --export $OUT
    # bring the checkpoint back: cat reference-model.tar.* | tar -x -C sketchkv/assets/
    python scripts/train_reference.py --resume sketchkv/assets/reference-model --export $OUT

Outputs: the checkpoint directory (default sketchkv/assets/reference-model/: config.json, model.safetensors with
transformers' names + the mtp.* tensors, generation_config.json, tokenizer.json, tokenizer_config.json,
heldout.json, trainer_state.json) and the report (default benchmarks/results/reference-model/reference-model.{md,png,json}).
--export DIR also writes the checkpoint as a tar in <= 15 MiB parts plus the report files to DIR.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import queue
import random
import shlex
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from reference_common import (  # noqa: E402,F401  (make_mtp / mtp_forward: re-exported, tests use them)
    GDN_USED, REPO, install_gdn_dispatch, log, make_mtp, mtp_forward, prune_fla_autotune, setup_env, versions)
from reference_common import parse_args as _parse_args  # noqa: E402

# Arguments that define the model / data / objective: taken from trainer_state.json when resuming.
FROZEN_ARGS = ("corpus_root", "heldout", "packages", "corpus_mb", "max_file_kb", "tokenizer_mb", "vocab", "hidden",
               "layers", "full_attn_every", "intermediate", "heads", "kv_heads", "head_dim", "partial_rotary",
               "rope_theta", "linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim",
               "max_positions", "seq_len", "batch_size", "long_seq_len", "long_every", "synth_frac",
               "answer_weight", "mtp_weight", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip",
               "beta2", "seed", "copy_pool")


def parse_args(argv=None):
    return _parse_args(argv, __doc__)


# ----------------------------------------------------------------------------------------------------------
# Environment / kernels
# ----------------------------------------------------------------------------------------------------------


def fla_guard_and_check(cfg, device, tol: float) -> dict:
    """fla-core 0.6.0 refuses the gated chunk backward on Hopper with 3.4 <= Triton < 3.7.1 (its guard for a Triton
    miscompile at BK=64). With linear_key_head_dim == 128 the kernel uses BK=128; then the guard is bypassed
    (`fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`). Either way fla's chunk_gated_delta_rule (through
    transformers' binding, bf16 q/k/v/beta, fp32 g, like the model) is checked against transformers' fp32 PyTorch
    reference, forward and backward, at B=2, T=1024; the run aborts above `tol` relative error."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as M
    out = {"guard_bypassed": False}
    import fla.ops.common.chunk_o as co
    guard = (bool(getattr(co, "IS_NVIDIA_HOPPER", False)) and bool(getattr(co, "TRITON_ABOVE_3_4_0", False))
             and not bool(getattr(co, "TRITON_ABOVE_3_7_1", True)))
    out["guard_active"] = guard
    if guard:
        if cfg.linear_key_head_dim != 128:
            raise SystemExit("fla's Hopper/Triton<3.7.1 guard is active and linear_key_head_dim != 128: refusing to "
                             "bypass it (the miscompile hits BK=64). Use --linear-key-dim 128.")
        co.TRITON_ABOVE_3_7_1 = True
        out["guard_bypassed"] = True
        log("fla guard bypassed: fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True (linear_key_head_dim == 128)")
    bound = M.torch_chunk_gated_delta_rule
    bound = getattr(bound, "_bound", bound)
    ref = getattr(bound, "__wrapped__", bound)
    out.update(gdn_grad_check(bound, ref, cfg, device))
    out["tol"] = tol
    log("GDN check fla vs fp32 torch reference (fwd+bwd, B=2 T=1024): " +
        " ".join(f"{n}={e:.4f}" for n, e in out["rel_err"].items()) +
        f"  (first call incl. compile/autotune {out['first_call_s']:.0f}s)")
    if not all(math.isfinite(e) and e <= tol for e in out["rel_err"].values()):
        raise SystemExit(f"fla chunk_gated_delta_rule disagrees with the PyTorch reference (max rel err "
                         f"{out['max_rel_err']:.4f} > {tol}): aborting")
    return out


def gdn_grad_check(fast, ref, cfg, device, B=2, T=1024) -> dict:
    """Relative errors of `fast` (bf16 q/k/v/beta, fp32 g, as the model calls it) against `ref` on fp32 copies of
    the same inputs: output and the gradients of q, k, v, g, beta for a fixed random upstream gradient."""
    import torch
    import torch.nn.functional as F
    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator(device="cpu").manual_seed(1234)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = rnd(B, T, H, K).bfloat16()
    k = rnd(B, T, H, K).bfloat16()
    v = rnd(B, T, HV, V).bfloat16()
    a_log = torch.empty(HV).uniform_(0.01, 16, generator=gen).log().to(device)
    g = (-a_log.exp() * F.softplus(rnd(B, T, HV) + 1.0)).float()
    beta = torch.sigmoid(rnd(B, T, HV)).bfloat16()
    do = rnd(B, T, HV, V)

    def run(fn, tensors):
        ts = [t.detach().clone().requires_grad_(True) for t in tensors]
        o, _ = fn(ts[0], ts[1], ts[2], g=ts[3], beta=ts[4], initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=True)
        (o.float() * do).sum().backward()
        return [o.detach().float()] + [t.grad.detach().float() for t in ts]

    t0 = time.time()
    got = run(fast, [q, k, v, g, beta])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_fast = time.time() - t0
    want = run(ref, [q.float(), k.float(), v.float(), g.float(), beta.float()])
    errs = {n: float((a - b).norm() / b.norm().clamp_min(1e-30))
            for n, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, want)}
    return {"rel_err": errs, "max_rel_err": max(errs.values()), "first_call_s": round(t_fast, 1),
            "shape": {"B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V}}


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------
def build_config(args, vocab_size: int, eot_id: int, im_end_id: int):
    from transformers import Qwen3_5TextConfig
    layer_types = ["full_attention" if (i + 1) % args.full_attn_every == 0 else "linear_attention"
                   for i in range(args.layers)]
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, hidden_act="silu", max_position_embeddings=args.max_positions,
        initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rope_theta),
                         "partial_rotary_factor": float(args.partial_rotary)},
        attention_bias=False, attention_dropout=0.0, linear_conv_kernel_dim=4,
        linear_key_head_dim=args.linear_key_dim, linear_value_head_dim=args.linear_value_dim,
        linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
        layer_types=layer_types, bos_token_id=None, eos_token_id=eot_id, pad_token_id=None,
    )
    cfg.mtp_num_hidden_layers = 1
    return cfg


def build_model(cfg, device):
    from transformers import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="sdpa")
    cfg = model.config
    mtp = make_mtp(cfg)
    return model.to(device), mtp.to(device)


def count_params(model, mtp) -> dict:
    main = sum(p.numel() for p in model.parameters())
    m = sum(p.numel() for p in mtp.parameters())
    return {"main": main, "mtp": m, "total": main + m}


def export_state_dict(model, mtp, dtype):
    sd = {}
    tied = model.config.tie_word_embeddings
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue
        sd[k] = v.detach().to(dtype).contiguous().cpu()
    for k, v in mtp.state_dict().items():
        sd[f"mtp.{k}"] = v.detach().to(dtype).contiguous().cpu()
    return sd


def save_checkpoint(out_dir, model, mtp, tok, heldout_info, trainer_state, eot_id, im_end_id) -> dict:
    import torch
    from safetensors.torch import save_file
    import reference_data as rd
    os.makedirs(out_dir, exist_ok=True)
    sd = export_state_dict(model, mtp, torch.bfloat16)
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    cfg["mtp_num_hidden_layers"] = 1
    cfg["dtype"] = "bfloat16"
    cfg["torch_dtype"] = "bfloat16"
    for junk in ("_attn_implementation_autoset", "attn_implementation", "_name_or_path", "id2label", "label2id",
                 "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
                 "output_hidden_states", "return_dict"):
        cfg.pop(junk, None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    gen = {"bos_token_id": None, "eos_token_id": [eot_id, im_end_id], "pad_token_id": eot_id, "do_sample": False}
    try:
        import transformers
        gen["transformers_version"] = transformers.__version__
    except Exception:
        pass
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    rd.save_tokenizer(tok, out_dir, model_max_length=model.config.max_position_embeddings)
    with open(os.path.join(out_dir, "heldout.json"), "w") as f:
        json.dump(heldout_info, f, indent=1)
    with open(os.path.join(out_dir, "trainer_state.json"), "w") as f:
        json.dump(trainer_state, f, indent=1)
    return {"file_bytes": os.path.getsize(os.path.join(out_dir, "model.safetensors")), "tensors": len(sd)}


# ----------------------------------------------------------------------------------------------------------
# Data preparation
# ----------------------------------------------------------------------------------------------------------
def prepare_data(args, tok_dir=None):
    """Corpus -> (tokenizer, token stream, tokenized function pool, split, info). Train the tokenizer unless
    `tok_dir` has one (resume)."""
    import numpy as np
    import reference_data as rd
    t0 = time.time()
    root = os.path.abspath(args.corpus_root or rd.default_corpus_root())
    heldout = [s for s in args.heldout.split(",") if s]
    packages = [s for s in args.packages.split(",") if s] if args.packages else None
    split = rd.discover_corpus(root, heldout, packages, args.max_file_kb, args.corpus_mb, args.seed)
    if not split.train:
        raise SystemExit(f"no training files found under {root}")
    missing = [h for h in heldout if not any(f.package == h for f in split.heldout)]
    if missing:
        log(f"WARNING: held-out packages not found under {root}: {missing}")
    t_disc = time.time()
    texts = rd.read_files(root, split.train, args.workers)
    t_read = time.time()
    log(f"corpus: {root}: {len(texts)} training files, {sum(map(len, texts.values())) / 1e6:.1f} MB chars "
        f"({split.train_bytes_available / 1e6:.0f} MB available, cap {args.corpus_mb:g} MB), "
        f"{len(split.heldout)} held-out files in {heldout}, {split.excluded_vendored} vendored copies excluded; "
        f"read in {t_read - t_disc:.1f}s")
    funcs_src = rd.function_pool(texts, args.workers, args.copy_pool, args.seed)
    t_func = time.time()
    if tok_dir is not None:
        tok = rd.load_tokenizer(tok_dir)
        t_tok = time.time()
        log(f"tokenizer loaded from {tok_dir}")
    else:
        rels = sorted(texts)
        random.Random(args.seed + 1).shuffle(rels)
        sample, n = [], 0
        for r in rels:
            if n >= args.tokenizer_mb * 1e6:
                break
            sample.append(texts[r])
            n += len(texts[r])
        tok = rd.train_tokenizer(sample, args.vocab)
        t_tok = time.time()
        log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()} trained on {n / 1e6:.1f} MB in "
            f"{t_tok - t_func:.1f}s")
    pkgs, streams = rd.build_package_streams(tok, split.train, texts)
    order = list(range(len(pkgs)))
    random.Random(args.seed + 2).shuffle(order)
    stream = np.concatenate([streams[i] for i in order])
    n_chars = sum(len(rd.FILE_HEADER.format(rel=r)) + len(t) for r, t in texts.items())
    encs = tok.encode_batch([s for s, _ in funcs_src], add_special_tokens=False) if funcs_src else []
    funcs = []
    for (_, sig_len), e in zip(funcs_src, encs):
        ids = np.asarray(e.ids, dtype=np.int64)
        sig_ntok = sum(1 for (_, end) in e.offsets if end <= sig_len)
        if 0 < sig_ntok < len(ids):
            funcs.append((ids, sig_ntok))
    t_enc = time.time()
    pkg_tokens = {pkgs[i]: int(len(streams[i])) for i in range(len(pkgs))}
    file_list = sorted(f.rel for f in split.train if f.rel in texts)
    info = {
        "corpus_root": root,
        "train_files": len(file_list),
        "train_chars": n_chars,
        "train_tokens": int(len(stream)),
        "chars_per_token": n_chars / max(len(stream), 1),
        "train_packages": len(pkgs),
        "largest_packages_tokens": dict(sorted(pkg_tokens.items(), key=lambda kv: -kv[1])[:12]),
        "train_bytes_available": split.train_bytes_available,
        "vendored_heldout_copies_excluded": split.excluded_vendored,
        "skipped_large_files": split.skipped_large,
        "train_file_list_sha1": hashlib.sha1("\n".join(file_list).encode()).hexdigest(),
        "copy_pool_functions": len(funcs),
        "timing_s": {"discover": round(t_disc - t0, 1), "read": round(t_read - t_disc, 1),
                     "functions": round(t_func - t_read, 1), "tokenizer": round(t_tok - t_func, 1),
                     "encode": round(t_enc - t_tok, 1), "total": round(t_enc - t0, 1)},
    }
    log(f"data: {len(stream) / 1e6:.1f}M training tokens ({info['chars_per_token']:.2f} chars/token) from "
        f"{len(pkgs)} packages, {len(funcs)} functions for the copy task; data prep {t_enc - t0:.1f}s")
    del texts
    return tok, stream, funcs, split, info


def heldout_manifest(split) -> dict:
    files = sorted(split.heldout, key=lambda f: f.rel)
    by_pkg = {}
    for f in files:
        by_pkg.setdefault(f.package, {"files": 0, "bytes": 0})
        by_pkg[f.package]["files"] += 1
        by_pkg[f.package]["bytes"] += f.size
    return {
        "rule": "a file is held out iff its top-level package (first path component under the corpus root) is "
                "listed; files under a directory named like a held-out package elsewhere (vendored copies, "
                "e.g. pip/_vendor/rich) are used neither for training nor for evaluation",
        "corpus_root": split.root,
        "packages": split.heldout_packages,
        "per_package": by_pkg,
        "files": [{"path": f.rel, "bytes": f.size} for f in files],
    }


class Prefetcher:
    """Builds batches in a background thread (numpy + the Rust tokenizer release the GIL)."""

    def __init__(self, builder, schedule, start_step, depth=3):
        self.builder, self.schedule = builder, schedule
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.step = start_step
        self.stop = False
        self.error = None
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        import torch
        step = self.step
        try:
            while not self.stop:
                rows, length = self.schedule(step)
                ids, ans, n_syn = self.builder.batch(step, rows, length)
                ids_t = torch.from_numpy(ids)
                ans_t = torch.from_numpy(ans)
                if torch.cuda.is_available():
                    ids_t, ans_t = ids_t.pin_memory(), ans_t.pin_memory()
                while not self.stop:
                    try:
                        self.q.put((step, ids_t, ans_t, n_syn), timeout=0.5)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BaseException as e:  # surfaced in get()
            self.error = e
            self.q.put(None)

    def get(self):
        item = self.q.get()
        if item is None:
            raise RuntimeError("batch builder failed") from self.error
        return item

    def close(self):
        self.stop = True


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------
def lr_at(step, planned, args, rewarm_from=None):
    peak = args.lr
    if step < args.warmup_steps:
        lr = peak * (step + 1) / args.warmup_steps
    else:
        p = min(1.0, (step - args.warmup_steps) / max(1, planned - args.warmup_steps))
        lr = peak * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
    if rewarm_from is not None:
        lr *= min(1.0, (step - rewarm_from + 1) / max(1, args.rewarm_steps))
    return lr


def train(args) -> int:
    t_proc = time.time()
    setup_env()
    import numpy as np
    import reference_data as rd

    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else
                                                 "scripts/train_reference.py"] + sys.argv[1:])
    prev = None
    if args.resume:
        with open(os.path.join(args.resume, "trainer_state.json")) as f:
            prev = json.load(f)
        for k in FROZEN_ARGS:
            if k in prev["args"]:
                setattr(args, k, prev["args"][k])
        log(f"resuming {args.resume} at step {prev['step']} (run {prev['run_id']})")
    random.seed(args.seed)
    np.random.seed(args.seed)
    # data first: its worker processes are forked before torch / CUDA / tokenizer threads exist
    tok, stream, funcs, split, data_info = prepare_data(args, tok_dir=args.resume)
    import torch
    import torch.nn.functional as F
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    eot_id, im_end_id = tok.token_to_id(rd.EOT), tok.token_to_id("<|im_end|>")
    _, ends_nl = rd.token_tables(tok)
    if prev and prev.get("data", {}).get("train_file_list_sha1") not in (None, data_info["train_file_list_sha1"]):
        log("WARNING: the training file selection differs from the run being resumed (different corpus root?)")

    # --- model, kernels -------------------------------------------------------------------------------------
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M  # noqa: F401  (binds fla when present)
    gdn_info = install_gdn_dispatch()
    kernel_info = {"gdn_binding": gdn_info, "attn_implementation": "sdpa"}
    cfg = build_config(args, tok.get_vocab_size(with_added_tokens=True), eot_id, im_end_id)
    if device.type == "cuda":
        fla_ok = "fla." in gdn_info["torch_chunk_gated_delta_rule"]["cuda"]
        if not fla_ok and not args.allow_torch_gdn:
            raise SystemExit("transformers did not bind fla's chunk_gated_delta_rule (is fla-core installed?); "
                             "refusing to train with the PyTorch reference (--allow-torch-gdn overrides)")
        if fla_ok:
            if args.fla_autotune == "lite":
                kernel_info["fla_autotune"] = prune_fla_autotune(args.fla_max_configs)
                log(f"fla autotune lite: {kernel_info['fla_autotune']}")
            else:
                kernel_info["fla_autotune"] = "full"
            kernel_info["gdn_check"] = fla_guard_and_check(cfg, device, args.gdn_check_tol)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log(f"GDN kernels: cuda -> {gdn_info['torch_chunk_gated_delta_rule']['cuda']}; "
        f"cpu -> {gdn_info['torch_chunk_gated_delta_rule']['cpu']}")

    torch.manual_seed(args.seed)
    model, mtp = build_model(cfg, device)
    cfg = model.config
    params = count_params(model, mtp)
    log(f"model: Qwen3_5ForCausalLM {params['main'] / 1e6:.2f}M params + MTP {params['mtp'] / 1e6:.2f}M = "
        f"{params['total'] / 1e6:.2f}M (bf16 ~{params['total'] * 2 / 2**20:.1f} MiB); layers {cfg.layer_types}; "
        f"attn impl {cfg._attn_implementation}")
    all_params = list(model.parameters()) + list(mtp.parameters())
    decay, no_decay = [], []
    for n, p in list(model.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]:
        (no_decay if p.ndim < 2 or "embed_tokens" in n else decay).append(p)
    opt_kw = {"lr": args.lr, "betas": (0.9, args.beta2), "eps": 1e-8}
    if device.type == "cuda":
        opt_kw["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kw)

    run_id = prev["run_id"] if prev else hashlib.sha1(f"{time.time()}-{os.getpid()}".encode()).hexdigest()[:12]
    step = 0
    tokens_seen = 0
    used_train_s = 0.0
    history = []
    rewarm_from = None
    planned = args.max_steps or 10**9
    state_path = os.path.join(args.state_dir, "state.pt")
    commands = list(prev.get("commands", [])) if prev else []
    commands.append(command)
    if prev:
        step, tokens_seen = prev["step"], prev["tokens_seen"]
        used_train_s, history = prev["train_seconds"], prev.get("history", [])
        if args.max_steps is None:
            planned = prev.get("planned_total_steps", planned)
        full = None
        if os.path.exists(state_path):
            full = torch.load(state_path, map_location="cpu", weights_only=False)
            if full.get("run_id") != run_id or full.get("step") != step:
                log(f"state {state_path} is for run {full.get('run_id')} step {full.get('step')}: ignored")
                full = None
        if full is not None:
            model.load_state_dict(full["model"])
            mtp.load_state_dict(full["mtp"])
            opt.load_state_dict(full["opt"])
            log(f"restored fp32 weights and AdamW state from {state_path}")
        else:
            from safetensors.torch import load_file
            sd = load_file(os.path.join(args.resume, "model.safetensors"))
            msd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
            if cfg.tie_word_embeddings:
                msd["lm_head.weight"] = msd["model.embed_tokens.weight"]
            model.load_state_dict({k: v.float() for k, v in msd.items()}, strict=True)
            mtp.load_state_dict({k[4:]: v.float() for k, v in sd.items() if k.startswith("mtp.")}, strict=True)
            rewarm_from = step
            log(f"no optimizer state for this run in {args.state_dir}: resumed from the bf16 checkpoint with a "
                f"fresh AdamW and {args.rewarm_steps} LR re-warmup steps")
        if cfg.tie_word_embeddings:
            model.tie_weights()

    # --- schedule / data -------------------------------------------------------------------------------------
    L, B = args.seq_len, args.batch_size
    tokens_per_step = L * B
    long_rows = (tokens_per_step // args.long_seq_len) if args.long_every > 0 else 0
    use_long = args.long_every > 0 and long_rows >= 1

    def shape_of(s):
        if use_long and s % args.long_every == args.long_every - 1:
            return long_rows, args.long_seq_len
        return B, L

    builder = rd.BatchBuilder(tok, stream, funcs, ends_nl, args.seed, args.synth_frac)
    pref = Prefetcher(builder, shape_of, step)

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    model.train()
    mtp.train()
    V = cfg.vocab_size
    t_train0 = time.time()
    reserve = 15.0 + (args.eval_reserve_minutes * 60 if args.eval else 0.0)
    stop_at = min(t_train0 + args.minutes * 60, t_proc + args.wall_minutes * 60 - reserve)
    def total_left_after():  # training seconds planned for later commands of this run
        if args.total_minutes is None:
            return 0.0
        return max(0.0, args.total_minutes * 60 - used_train_s - (stop_at - t_train0))
    log(f"training: {B}x{L} tokens/step" + (f", 1 step in {args.long_every}: {long_rows}x{args.long_seq_len}"
                                            if use_long else "") +
        f"; budget this command {max(0, stop_at - t_train0) / 60:.2f} min (of --minutes {args.minutes:g}, wall cap "
        f"{args.wall_minutes:g}); " + (f"whole run {args.total_minutes:g} min, " if args.total_minutes else
                                        "LR schedule ends with this command, ")
        + f"{used_train_s / 60:.2f} min used before")
    step_times: list[float] = []
    acc = {"lm": 0.0, "mtp": 0.0, "ans": 0.0, "n": 0, "ans_n": 0, "tok": 0, "t": time.time(), "syn": 0, "rows": 0}
    first_step_s = None
    start_step = step
    last = time.time()
    n_since = 0
    while True:
        now = time.time()
        if now >= stop_at or (args.max_steps is not None and step >= args.max_steps):
            break
        if step >= planned and args.max_steps is None and total_left_after() <= 0 and step > start_step + 10:
            break
        _, ids, ans, n_syn = pref.get()
        ids = ids.to(device, non_blocking=True)
        ans = ans.to(device, non_blocking=True)
        lr = lr_at(step, planned, args, rewarm_from)
        for gp in opt.param_groups:
            gp["lr"] = lr
        x, y, a = ids[:, :-1], ids[:, 1:], ans[:, 1:]
        with autocast:
            h = model.model(input_ids=x, use_cache=False).last_hidden_state
            logits = model.lm_head(h)
            ce = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1), reduction="none").view_as(y)
            lm_loss = ce.mean()
            af = a.float()
            n_ans = af.sum()
            ans_loss = (ce * af).sum() / n_ans.clamp_min(1.0)
            mlogits = mtp_forward(model, mtp, x, h)
            mtp_loss = F.cross_entropy(mlogits.float().reshape(-1, V), y[:, 1:].reshape(-1))
        loss = lm_loss + args.mtp_weight * mtp_loss + args.answer_weight * ans_loss
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(all_params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += x.numel()
        acc["lm"] += lm_loss.detach()
        acc["mtp"] += mtp_loss.detach()
        acc["ans"] += (ce * af).sum().detach()
        acc["ans_n"] += n_ans.detach()
        acc["n"] += 1
        acc["tok"] += x.numel()
        acc["syn"] += n_syn
        acc["rows"] += x.shape[0]
        n_since += 1
        if step - start_step <= 3 or step % args.log_every == 0:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            dt = now - last
            if step - start_step == 1:
                first_step_s = dt
                log(f"first step (incl. kernel compile/autotune) {dt:.1f}s; Gated DeltaNet ran through "
                    f"{GDN_USED.get('torch_chunk_gated_delta_rule')}")
                if device.type == "cuda" and args.fla_autotune == "lite" and "fla_autotune" in kernel_info:
                    prune_fla_autotune(args.fla_max_configs)  # kernels of modules imported lazily
            elif step - start_step > 3:
                step_times.append(dt / n_since)
            last = now
            n_since = 0
        if step % args.log_every == 0 or (args.max_steps is not None and step >= args.max_steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            # plan the schedule from the measured step time: steps left = time left (this command + later ones)
            if step_times and args.max_steps is None:
                recent = step_times[-8:]
                st = sum(recent) / len(recent)
                planned = step + int(max(0.0, stop_at - now) / st) + int(total_left_after() / st)
            n = max(1, acc["n"])
            lm_v = float(acc["lm"]) / n
            if not math.isfinite(lm_v):
                raise SystemExit(f"non-finite training loss at step {step}: aborting without saving")
            mtp_v = float(acc["mtp"]) / n
            ans_n = float(acc["ans_n"])
            ans_v = float(acc["ans"]) / ans_n if ans_n > 0 else float("nan")
            tps = acc["tok"] / max(1e-9, now - acc["t"])
            el = used_train_s + (now - t_train0)
            rec = {"step": step, "tokens": tokens_seen, "lm_loss": round(lm_v, 4), "mtp_loss": round(mtp_v, 4),
                   "answer_loss": None if math.isnan(ans_v) else round(ans_v, 4), "lr": lr,
                   "tok_per_s": round(tps), "train_s": round(el, 1), "grad_norm": round(float(gn), 3),
                   "synthetic_rows": f"{acc['syn']}/{acc['rows']}"}
            history.append(rec)
            mem = (f" mem {torch.cuda.max_memory_allocated() / 2**30:.1f}GiB" if device.type == "cuda" else "")
            log(f"step {step}/{planned if planned < 10**9 else '?'} tok {tokens_seen / 1e6:.1f}M loss {lm_v:.3f} "
                f"mtp {mtp_v:.3f} answer {ans_v:.3f} lr {lr:.2e} gnorm {float(gn):.2f} {tps / 1e3:.0f}K tok/s "
                f"train {el / 60:.2f}min{mem}")
            acc = {"lm": 0.0, "mtp": 0.0, "ans": 0.0, "n": 0, "ans_n": 0, "tok": 0, "t": now, "syn": 0, "rows": 0}
    pref.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    this_train_s = time.time() - t_train0
    used_train_s += this_train_s
    log(f"training stopped at step {step} after {this_train_s / 60:.2f} min in this command "
        f"({used_train_s / 60:.2f} min in total), {tokens_seen / 1e6:.1f}M tokens")

    # --- save ------------------------------------------------------------------------------------------------
    t_save0 = time.time()
    trainer_state = {
        "run_id": run_id, "step": step, "tokens_seen": tokens_seen, "train_seconds": round(used_train_s, 1),
        "planned_total_steps": planned if planned < 10**9 else step, "args": vars(args), "commands": commands,
        "history": history, "data": data_info, "params": params, "versions": versions(), "kernels": kernel_info,
        "gdn_used": dict(GDN_USED), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "first_step_s": first_step_s, "time_this_command_s": {"before_training": round(t_train0 - t_proc, 1),
                                                              "training": round(this_train_s, 1)},
        "mtp": {"position_ids": "t for (h_t, token_{t+1}) (vLLM MTP proposer convention)", "predicts": "t+2",
                "loss_weight": args.mtp_weight},
        "updated": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    save_info = save_checkpoint(args.out, model, mtp, tok, heldout_manifest(split), trainer_state, eot_id, im_end_id)
    log(f"saved {args.out}: model.safetensors {save_info['file_bytes'] / 2**20:.2f} MiB, "
        f"{save_info['tensors']} tensors")
    if args.state_dir:
        os.makedirs(args.state_dir, exist_ok=True)
        tmp = state_path + ".tmp"
        torch.save({"run_id": run_id, "step": step, "model": model.state_dict(), "mtp": mtp.state_dict(),
                    "opt": opt.state_dict()}, tmp)
        os.replace(tmp, state_path)
        log(f"saved full training state to {state_path}")
    t_save = time.time() - t_save0
    trainer_state["time_this_command_s"]["save"] = round(t_save, 1)
    with open(os.path.join(args.out, "trainer_state.json"), "w") as f:
        json.dump(trainer_state, f, indent=1)

    del opt, all_params, decay, no_decay
    if args.eval:
        import eval_reference as ev
        model.eval()
        mtp.eval()
        del model, mtp
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ev.evaluate_and_report(args, args.out, device, corpus_root=split.root, eval_command=None,
                               deadline=t_proc + args.wall_minutes * 60 - 5)
    elif args.export:
        import eval_reference as ev
        ev.export_artifacts(args.out, None, args.export)  # no report from this command
    log(f"done in {(time.time() - t_proc) / 60:.2f} min")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.eval_only:
        setup_env()
        import eval_reference as ev
        return ev.main_eval_only(args)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
