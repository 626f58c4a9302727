#!/usr/bin/env python3
"""Decode speed of the bundled reference model on CPU (issue 3: >= 20 tokens/s at 4K context on 2 cores),
next to Hugging Face transformers decoding the same prompt on the same cores in the same run.

    python benchmarks/bench_cpu_reference.py --context 4096 --tokens 128 --out benchmarks/results/cpu-reference.json

The prompt is held-out code (the model's `heldout.json` packages installed here, e.g. jinja2), cut to
`--context` tokens. Prefill is timed apart (time to first token); decode tok/s = generated tokens after
the first / their wall time. transformers runs `generate` with its cache (greedy, same prompt).
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch


def time_sketchkv(model: str, prompt: list[int], n: int) -> dict:
    from sketchkv.engine.llm_engine import LLMEngine
    from sketchkv.config import build_config
    from sketchkv.sampling_params import SamplingParams
    eng = LLMEngine(build_config(model=model, device="cpu", dtype="float32",
                                 max_num_batched_tokens=len(prompt), max_model_len=len(prompt) + n + 16))
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t0 = time.perf_counter()
    t_first = None
    out = None
    while eng.has_unfinished:
        for o in eng.step():
            out = o
            if t_first is None and o.token_ids:
                t_first = time.perf_counter()
    t1 = time.perf_counter()
    return {"ttft_s": t_first - t0, "decode_tok_s": (len(out.token_ids) - 1) / (t1 - t_first),
            "token_ids": out.token_ids}


def time_transformers(model: str, prompt: list[int], n: int) -> dict:
    # transformers binds fla's Triton kernels when fla is importable, and they cannot run on CPU tensors
    sys.modules.setdefault("fla", None)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        seq = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        t2 = time.perf_counter()
    # decode time = whole generate - its own prefill (measured by the 1-token generate)
    return {"ttft_s": t1 - t0, "decode_tok_s": (n - 1) / max(1e-9, (t2 - t1) - (t1 - t0)),
            "token_ids": seq[0, len(prompt):].tolist()}


def main() -> None:
    from sketchkv.config import default_model
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(), help="model directory (default: bundled reference model)")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=128, help="tokens to generate")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from sketchkv.eval.common import heldout_token_ids
    prompt = heldout_token_ids(args.model, args.context)
    ours = time_sketchkv(args.model, prompt, args.tokens)
    hf = None if args.no_hf else time_transformers(args.model, prompt, args.tokens)
    same = None
    if hf:
        same = next((i for i, (a, b) in enumerate(zip(ours["token_ids"], hf["token_ids"])) if a != b),
                    min(len(ours["token_ids"]), len(hf["token_ids"])))
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
        "context": args.context, "tokens": args.tokens,
        "sketchkv": {k: v for k, v in ours.items() if k != "token_ids"},
        "transformers": {k: v for k, v in hf.items() if k != "token_ids"} if hf else None,
        "greedy_tokens_identical_before_first_difference": same,
    }
    rows = [("sketchkv", ours)] + ([("transformers", hf)] if hf else [])
    print(f"\n{args.context}-token held-out prompt, {args.tokens} greedy tokens, {torch.get_num_threads()} threads")
    print("| engine | TTFT (s) | decode tok/s |\n|---|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['ttft_s']:.2f} | {r['decode_tok_s']:.1f} |")
    if same is not None:
        print(f"greedy tokens identical for the first {same} of {args.tokens}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
