#!/usr/bin/env python3
"""What the reference model's training and evaluation scripts share (project issue 3): paths and defaults, the
command-line arguments of both, the process environment, Gated DeltaNet kernel dispatch for transformers (fla on
GPU, the PyTorch reference on CPU), the MTP layer in transformers' terms, and library versions for the reports.

scripts/train_reference.py trains (and evaluates at the end through scripts/eval_reference.py);
scripts/eval_reference.py evaluates a checkpoint; both import this module, neither imports the other's
dependents back (train -> eval -> common).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

DEFAULT_OUT = os.path.join(REPO, "sketchkv", "assets", "reference-model")
DEFAULT_REPORT = os.path.join(REPO, "benchmarks", "results", "reference-model", "reference-model.md")
DEFAULT_STATE = os.path.join(REPO, "out", "reference-train-state")


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None, description: str | None = None):
    p = argparse.ArgumentParser(description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("paths")
    g.add_argument("--out", default=DEFAULT_OUT, help="checkpoint directory (default: %(default)s)")
    g.add_argument("--report", default=DEFAULT_REPORT, help="report .md path; .png/.json written next to it")
    g.add_argument("--state-dir", default=DEFAULT_STATE,
                   help="full training state (fp32 weights + AdamW) for --resume; kept out of the package")
    g.add_argument("--resume", default=None, metavar="DIR", help="continue training from checkpoint DIR")
    g.add_argument("--eval-only", default=None, metavar="DIR", help="only evaluate checkpoint DIR and write the report")
    g.add_argument("--export", default=None, metavar="DIR",
                   help="at the end, write the checkpoint as a tar split in <=15 MiB parts + the report files to DIR "
                        "(e.g. $OUT on the device machine)")
    g = p.add_argument_group("data")
    g.add_argument("--corpus-root", default=None, help="site-packages to read (default: this interpreter's purelib)")
    g.add_argument("--heldout", default="networkx,rich,jinja2,click", help="held-out packages (comma separated)")
    g.add_argument("--packages", default=None, help="restrict training to these packages (comma separated)")
    g.add_argument("--corpus-mb", type=float, default=400.0, help="cap on training source bytes (seeded file sample)")
    g.add_argument("--max-file-kb", type=int, default=512, help="skip larger files (generated tables)")
    g.add_argument("--tokenizer-mb", type=float, default=24.0, help="bytes of training text for the BPE trainer")
    g.add_argument("--vocab", type=int, default=8192)
    g.add_argument("--copy-pool", type=int, default=20000, help="functions available to the copy task")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=384)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--full-attn-every", type=int, default=4, help="every k-th layer is full attention")
    g.add_argument("--intermediate", type=int, default=768)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--partial-rotary", type=float, default=0.25)
    g.add_argument("--rope-theta", type=float, default=1e7)
    g.add_argument("--linear-key-heads", type=int, default=2)
    g.add_argument("--linear-value-heads", type=int, default=2)
    g.add_argument("--linear-key-dim", type=int, default=128)
    g.add_argument("--linear-value-dim", type=int, default=128)
    g.add_argument("--max-positions", type=int, default=262144)
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=16384)
    g.add_argument("--batch-size", type=int, default=4)
    g.add_argument("--long-seq-len", type=int, default=65536,
                   help="every --long-every-th step trains on rows of this length (same tokens per step)")
    g.add_argument("--long-every", type=int, default=4, help="0 disables long steps")
    g.add_argument("--synth-frac", type=float, default=0.3, help="share of rows that are synthetic retrieval rows")
    g.add_argument("--answer-weight", type=float, default=0.2,
                   help="extra loss weight: mean CE over retrieval-answer tokens (asserted values, copied bodies)")
    g.add_argument("--mtp-weight", type=float, default=0.3)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup-steps", type=int, default=150)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--minutes", type=float, default=8.0, help="training-loop budget of this command (minutes)")
    g.add_argument("--total-minutes", type=float, default=None,
                   help="when the run is split over several commands: training minutes of all of them together, "
                        "for the LR schedule of this one (default: this command is the last one, the LR reaches its "
                        "minimum when this command's budget is spent)")
    g.add_argument("--wall-minutes", type=float, default=9.0,
                   help="hard cap for this whole process: training stops early enough to save (and evaluate)")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (tests)")
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--device", default="auto")
    g.add_argument("--rewarm-steps", type=int, default=50, help="LR re-warmup when resuming without optimizer state")
    g = p.add_argument_group("fla / triton")
    g.add_argument("--fla-autotune", choices=["lite", "full"], default="lite",
                   help="lite: each fla autotuner tries at most --fla-max-configs configs (cuts first-use compile)")
    g.add_argument("--fla-max-configs", type=int, default=2)
    g.add_argument("--gdn-check-tol", type=float, default=0.02, help="max relative error of fla vs torch reference")
    g.add_argument("--allow-torch-gdn", action="store_true", help="allow training on GPU without fla (very slow)")
    g = p.add_argument_group("evaluation")
    g.add_argument("--no-eval", dest="eval", action="store_false", help="skip evaluation after training")
    g.add_argument("--eval-lengths", default="4096,16384,32768,65536,131072,262144")
    g.add_argument("--eval-samples", type=int, default=20)
    g.add_argument("--eval-ppl-tokens", type=int, default=1 << 20)
    g.add_argument("--eval-ppl-seq", type=int, default=16384)
    g.add_argument("--eval-registry", type=int, default=8, help="entries in the lookup registry (1 is queried)")
    g.add_argument("--eval-generate-check", type=int, default=2,
                   help="per task, run real cached greedy generation on this many shortest-length samples and "
                        "compare with the teacher-forced verdict")
    g.add_argument("--eval-reserve-minutes", type=float, default=2.5,
                   help="wall time kept for the evaluation after training (within --wall-minutes)")
    return p.parse_args(argv)


def setup_env() -> None:
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(REPO, "out", "triton-cache"))
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def _closure_var(fn, name, depth=3):
    """Value of the free variable `name` of `fn`, also looking into functions it closes over (decorator layers)."""
    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__closure__", None):
        return None
    inner = []
    for var, cell in zip(code.co_freevars, fn.__closure__):
        try:
            val = cell.cell_contents
        except ValueError:
            continue
        if var == name:
            return val
        if callable(val) and getattr(val, "__code__", None) is not None:
            inner.append(val)
    if depth > 0:
        for f in inner:
            val = _closure_var(f, name, depth - 1)
            if val is not None:
                return val
    return None


GDN_USED: dict[str, str] = {}


def install_gdn_dispatch() -> dict:
    """Route transformers' Gated DeltaNet functions by device.

    transformers binds fla's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` at import time when fla
    is importable, on every device; fla's Triton kernels cannot run on CPU tensors ("0 active drivers"). The module
    globals of modeling_qwen3_5 are replaced by a dispatcher: CUDA tensors -> transformers' binding (fla when it
    found fla), other tensors -> transformers' PyTorch reference (`__wrapped__`). Returns what was bound.
    """
    import transformers.models.qwen3_5.modeling_qwen3_5 as M
    info = {}
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        bound = getattr(M, name)
        if getattr(bound, "_sketchkv_dispatch", False):
            info[name] = bound._sketchkv_info
            continue
        torch_fn = getattr(bound, "__wrapped__", bound)
        impl = _closure_var(bound, "implementation")
        if impl is None:
            impl_name = "unknown (transformers wrapper without an `implementation` closure)"
            fast = False
        else:
            impl_name = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
            fast = impl is not torch_fn
        torch_name = f"{torch_fn.__module__}.{torch_fn.__name__} (PyTorch reference)"

        def dispatch(*a, _bound=bound, _torch=torch_fn, _fast=fast, _name=name, _impl=impl_name, _tn=torch_name, **kw):
            q = a[0] if a else kw.get("query")
            if _fast and q.is_cuda:
                GDN_USED[_name] = _impl
                return _bound(*a, **kw)
            GDN_USED[_name] = _tn
            return _torch(*a, **kw)

        dispatch._sketchkv_dispatch = True
        dispatch._sketchkv_info = {"cuda": impl_name if fast else torch_name, "cpu": torch_name}
        dispatch.__wrapped__ = torch_fn
        dispatch._bound = bound
        setattr(M, name, dispatch)
        info[name] = dispatch._sketchkv_info
    return info


def prune_fla_autotune(max_configs: int) -> dict:
    """Make every fla Triton autotuner benchmark (hence compile) at most `max_configs` configs.

    fla has no switch that restricts its autotune lists (it has FLA_CACHE_MODE + FLA_CONFIG_DIR for precomputed
    per-GPU configs, of which the wheel ships none); the lists are pruned in-process through Triton's own
    `early_config_prune` hook, preferring 4 warps, 64-wide blocks and 2 pipeline stages.
    """
    from triton.runtime.autotuner import Autotuner

    def score(c):
        blocks = [v for k, v in c.kwargs.items() if isinstance(v, int) and k.startswith("B") and v > 0]
        return (abs(math.log2(max(c.num_warps, 1) / 4)), sum(abs(math.log2(b / 64)) for b in blocks),
                abs(c.num_stages - 2))

    def limit(at):
        orig = at.early_config_prune

        def early_prune(configs, nargs, **kw):
            cs = list(orig(configs, nargs, **kw)) if orig is not None else list(configs)
            return sorted(cs, key=score)[:max_configs] or cs

        at.early_config_prune = early_prune

    seen, n_configs_before, n_new = set(), 0, 0
    for mname, mod in list(sys.modules.items()):
        if mod is None or not (mname == "fla" or mname.startswith("fla.")):
            continue
        for obj in list(vars(mod).values()):
            o, depth = obj, 0
            while o is not None and depth < 5:
                if isinstance(o, Autotuner) and id(o) not in seen:
                    seen.add(id(o))
                    n_configs_before += len(o.configs)
                    if not getattr(o, "_sketchkv_pruned", False):
                        limit(o)
                        o._sketchkv_pruned = True
                        n_new += 1
                o = getattr(o, "fn", None)
                depth += 1
    return {"autotuners": len(seen), "newly_pruned": n_new, "configs_listed": n_configs_before,
            "max_configs_each": max_configs}


def make_mtp(cfg):
    """One MTP layer with the tensor names of real Qwen3.5 checkpoints (mtp.*); predicts token t+2 from the
    final-normed hidden state h_t and the embedding of token t+1 (embedding / LM head shared with the model)."""
    import torch
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    class MTP(nn.Module):
        def __init__(self, config):
            super().__init__()
            h = config.hidden_size
            mcfg = copy.deepcopy(config)
            mcfg.layer_types = ["full_attention"]
            mcfg.num_hidden_layers = 1
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mcfg, 0)])
            self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=config.initializer_range)
                elif isinstance(m, Qwen3_5RMSNorm):
                    nn.init.zeros_(m.weight)

        def forward(self, emb_next, hidden, position_embeddings):
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1))
            for layer in self.layers:
                x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
                if isinstance(x, tuple):
                    x = x[0]
            return self.norm(x)

    return MTP(cfg)


def mtp_forward(model, mtp, input_ids, hidden):
    """MTP logits for positions 0..T-2 (predicting token t+2). Position ids of (h_t, token_{t+1}) are t, as in
    vLLM's MTP proposer."""
    import torch
    B, T = input_ids.shape
    pos = torch.arange(T - 1, device=input_ids.device).view(1, 1, -1).expand(3, B, -1)
    pe = model.model.rotary_emb(hidden, pos)
    emb = model.model.embed_tokens(input_ids[:, 1:])
    return model.lm_head(mtp(emb, hidden[:, :-1], pe))


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "triton", "fla", "tokenizers", "safetensors", "numpy"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception:
            out[mod] = None
    return out
