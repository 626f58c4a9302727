"""MTP speculative decoding: mean accepted length per step for n drafts, and wall-clock decode speed.

    python benchmarks/bench_mtp.py --model MODEL_DIR --n 1 3 7 --out benchmarks/results/mtp-accept.json
    python benchmarks/bench_mtp.py --tiny /tmp/tiny-mtp --n 1 3 7      # CPU smoke: random tiny model + MTP

Prompts come from held-out code (MODEL/heldout.json, or files/directories given with --docs), in
two styles, reported separately (as the seed does):
  copy     a file, then its `# file:` header again and its first lines: the continuation repeats
           text from the context (drafts are easy);
  explain  a file inside the chat template with a request to explain it (free text; with a model
           without a chat template: the file cut at a random line, continued as new code).
For each n (and n = 0 as the baseline) the same prompts are generated greedily in one batch; the
report gives mean accepted length (tokens per verification step: accepted drafts + 1), acceptance
by draft position, tokens/s, and whether the tokens equal the baseline's (they must at
temperature 0). Random-weight models accept ~nothing: the numbers mean something only for a
trained MTP layer. The tokens/s time prefill and decode together (every run prefills its prompts),
unless --prefix-cached: then the warm-up run fills the prefix cache, each timed run prefills only past the
prompts' last block boundary (where the GDN state and drafter ring were saved), and the reported tok/s
count from the step that gave every sequence its first token (decode speed; admission, which hashes the
whole prompt against the prefix cache, ~26 ms per 248K-token prompt on the H200 machine's CPU, is not
decode).
"""
import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import random
import sys
import time

import torch

sys.path.insert(0, ".")
from sketchkv import LLM, SamplingParams  # noqa: E402
from sketchkv.eval.common import FILE_HEADER, load_documents  # noqa: E402


def filler_ids(tok, docs, skip, need: int, rng) -> list[int]:
    """About `need` tokens of other held-out files, each under its `# file:` header (--fill-context)."""
    others = [d for d in docs if d is not skip] or [skip]
    rng.shuffle(others)
    ids, i = [], 0
    while len(ids) < need:
        d = others[i % len(others)]
        ids += tok.encode(FILE_HEADER.format(rel=d.rel) + d.text + "\n")
        i += 1
    return ids[:need]


def build_prompts(llm: LLM, docs, style: str, count: int, context: int, seed: int, fill: bool = False) -> list[list[int]]:
    tok, rng = llm.tokenizer, random.Random(seed)
    docs = [d for d in docs if len(d.text) > 400]
    rng.shuffle(docs)
    prompts = []
    for d in docs:
        if len(prompts) == count:
            break
        text = d.text[:context * 3]  # ~3 characters per token for code; trimmed in tokens below
        if style == "copy":
            head = "\n".join(text.splitlines()[:3])
            ids = tok.encode(FILE_HEADER.format(rel=d.rel) + text)[:context - 64]
            tail = tok.encode("\n" + FILE_HEADER.format(rel=d.rel) + head)
            if fill:  # the file first, then other files: the text to copy lies ~context tokens back
                ids += filler_ids(tok, docs, d, context - len(ids) - len(tail), rng)
            ids += tail
        elif tok.chat_template:
            body = tok.decode(tok.encode(text)[:context - 64])
            if fill:  # other files before the one to explain
                body = tok.decode(filler_ids(tok, docs, d, context - 96 - len(tok.encode(body)), rng)) + body
            ids = tok.apply_chat_template([{"role": "user", "content": f"Explain what this code does:\n\n{body}"}],
                                          add_generation_prompt=True)
            ids = tok.encode(ids) if isinstance(ids, str) else ids
        else:
            lines = text.splitlines()
            cut = rng.randrange(len(lines) // 2, len(lines))
            ids = tok.encode(FILE_HEADER.format(rel=d.rel) + "\n".join(lines[:cut]) + "\n")[-context:]
        prompts.append(ids)
    return prompts


PHASES = ("spec.propose", "runner.run", "spec.verify", "spec.commit", "spec.catch_up")


def profile_steps(llm: LLM, prompts, max_tokens: int, path: str, cached: bool = False) -> dict:
    """Where a speculative step's time goes: a short generate of the same batch under torch.profiler (apart
    from the timed run: profiling slows it). GPU time per engine phase (the ranges llm_engine.step names),
    host time per phase, kernel launches; operator tables written to `path`. cached: the prompts come from
    the prefix cache (decode steps only), else shuffled copies are prefilled first."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if not cached:
        rng = random.Random(len(prompts))
        prompts = [rng.sample(p, len(p)) for p in prompts]   # not cached
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    host = cProfile.Profile()   # Python-level host time: what keeps the GPU waiting between launches
    with profile(activities=acts) as prof:
        host.enable()
        llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        host.disable()
    phases: dict = {}
    for ev in prof.events():
        if ev.name in PHASES:
            kind = "gpu_ms" if ev.device_type == torch.autograd.DeviceType.CUDA else "host_ms"
            d = phases.setdefault(ev.name, {"gpu_ms": 0.0, "host_ms": 0.0, "calls": 0})
            d[kind] += ev.time_range.elapsed_us() / 1e3
            d["calls"] += kind == "host_ms"
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                       "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    with open(path, "w") as f:
        for key in ("self_cuda_time_total", "cpu_time_total"):
            try:
                f.write(f"== sorted by {key}\n" + ev.table(sort_by=key, row_limit=40) + "\n")
            except Exception as e:  # sort keys differ across torch versions
                f.write(f"== {key}: {e}\n")
    write_host_profile(host, path, mode="a")
    return {"phases": phases, "launch_calls": launches, "max_tokens": max_tokens, "table": path}


def write_host_profile(host, path: str, mode: str = "w") -> None:
    """cProfile's top functions by own and by cumulative time."""
    with open(path, mode) as f:
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(host, stream=buf).sort_stats(key).print_stats(35)
            f.write(f"== Python host time (cProfile), sorted by {key}\n" + buf.getvalue() + "\n")


def run(llm: LLM, prompts, max_tokens: int) -> dict:
    """Generate greedily; wall time end to end, and decode time: from the step that gave every sequence its first
    token to the end (what admission costs, hashing the prompts against the prefix cache, is not decode)."""
    eng, cuda = llm.engine, llm.engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    seqs = [eng.add_request(p, sp) for p in prompts]
    t_first = first_tokens = None
    while eng.has_unfinished:
        eng.step()
        if t_first is None and all(s.first_token_time is not None for s in seqs):
            sync()
            t_first, first_tokens = time.perf_counter(), sum(len(s.output_token_ids) for s in seqs)
    sync()
    end = time.perf_counter()
    n_tok = sum(len(s.output_token_ids) for s in seqs)
    spec = eng.runner.spec
    return {"tokens": [s.output_token_ids for s in seqs], "wall_s": end - t0, "generated": n_tok,
            "tok_per_s": n_tok / (end - t0), "decode_s": end - t_first,
            "decode_tok_per_s": (n_tok - first_tokens) / max(end - t_first, 1e-9),
            "prompt_cached_mean": sum(s.num_prompt_cached for s in seqs) / max(len(seqs), 1),
            **(spec.metrics() if spec else {})}


def make_tiny(path: str) -> str:
    from sketchkv.models.presets import save_random_checkpoint
    if not os.path.isfile(os.path.join(path, "config.json")):
        save_random_checkpoint("tiny-hybrid", path, mtp_layers=1)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir with mtp.* tensors (default: the bundled reference model)")
    ap.add_argument("--tiny", default=None, help="write (once) and use a random tiny hybrid with MTP at this path")
    ap.add_argument("--docs", nargs="*", default=[], help="held-out files/dirs (default: MODEL/heldout.json)")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--styles", nargs="+", default=["copy", "explain"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per style (generated as one batch)")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens (about; at most one file's unless --fill-context)")
    ap.add_argument("--fill-context", action="store_true",
                    help="pad every prompt to --context tokens with other held-out files: copy puts the file first and its "
                         "repeat after the filler (the text to copy is ~context tokens back, what a windowed drafter "
                         "cannot see), explain puts the filler before the file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per n after the warm-up (the median is reported)")
    ap.add_argument("--prefix-cached", action="store_true",
                    help="time decode: the warm-up fills the prefix cache, so each timed run re-prefills only past the "
                         "prompts' last block boundary (default: every run prefills its prompts, end-to-end tok/s)")
    ap.add_argument("--option", nargs="*", default=[], help="engine options KEY=VALUE (e.g. sparse=true enforce_eager=true)")
    ap.add_argument("--phases", action="store_true",
                    help="after the timed runs, one more run with a device sync at each engine phase: wall ms per step "
                         "per phase (scheduler, propose, prepare, forward, verify, commit, catch-up, Python GC, ...) in "
                         "the JSON; with --profile DIR also that run's cProfile in DIR/phases-STYLE-nN.txt")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after each timed run, profile a short run of the same batch (torch.profiler): GPU and host time "
                         "per engine phase and launches in the JSON, operator tables in DIR/profile-STYLE-nN.txt")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="A/B: do not move admitted requests' token lists to Python's permanent GC generation "
                         "(llm_engine.FREEZE_GC)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.no_gc_freeze:
        from sketchkv.engine import llm_engine
        llm_engine.FREEZE_GC = False
    from sketchkv.config import default_model
    model = make_tiny(a.tiny) if a.tiny else (a.model or default_model())
    opts = {}
    for kv in a.option:
        k, v = kv.split("=", 1)
        opts[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    docs = None
    if a.docs or not a.tiny:
        docs, source = load_documents(a.docs, model)
    else:  # the tiny random model: any Python source will do
        import sketchkv
        docs, source = load_documents([os.path.dirname(sketchkv.__file__)], model)
    # with --prefix-cached the reported speed (and the speedup over n = 0) is decode tok/s: after every sequence's
    # first token; else tokens over the whole run, prefill included
    speed = "decode_tok_per_s" if a.prefix_cached else "tok_per_s"
    results = {"model": model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
               "command": " ".join(sys.argv), "docs": source, "options": opts, "max_tokens": a.max_tokens,
               "context": a.context, "fill_context": a.fill_context,
               "timing": "decode (prompts from the prefix cache)" if a.prefix_cached else "end-to-end (prefill included)",
               "speed": speed,
               "styles": {}}
    for style in a.styles:
        rows = {}
        base = None
        for n in [0] + a.n:
            # no prefix caching (default): the warm-up and every timed run do the same work, prefill included
            llm = LLM(model, num_speculative_tokens=n, max_num_seqs=max(a.prompts, 1),
                      enable_prefix_caching=a.prefix_cached, **opts)
            prompts = build_prompts(llm, docs, style, a.prompts, a.context, a.seed, a.fill_context)
            if n and llm.engine.runner.spec is not None:
                mem = llm.engine.runner.spec.bytes_per_seq(a.context + a.max_tokens)
            else:
                mem = None
            # warm-up: the whole workload once. Speculative steps meet many batch shapes (the batch thins
            # out as sequences finish at different steps, eager verification rows vary), each a Triton
            # compile / fla autotune on first use, 0.1-0.8 s apiece (H200 run 22's profile): a server pays
            # them once, a timed run must not
            run(llm, prompts, a.max_tokens)
            timed = []
            for _ in range(a.repeats):   # a run of ~1K tokens is a fraction of a second: the median of a few
                if llm.engine.runner.spec is not None:
                    llm.engine.runner.spec.reset_metrics()
                timed.append(run(llm, prompts, a.max_tokens))
            r = sorted(timed, key=lambda x: x[speed])[len(timed) // 2]
            r["tok_per_s_runs"] = [x["tok_per_s"] for x in timed]
            r["decode_tok_per_s_runs"] = [x["decode_tok_per_s"] for x in timed]
            toks = r.pop("tokens")
            if n == 0:
                base = toks
            r["identical_to_baseline"] = toks == base
            # bf16 on a GPU: verification batches rows differently, so near-ties may flip; how far they agree
            r["agree_prefix_frac"] = sum(next((i for i, (x, y) in enumerate(zip(t, b)) if x != y), len(t)) / max(len(t), 1)
                                         for t, b in zip(toks, base)) / max(len(toks), 1)
            r["spec_bytes_per_agent"] = mem
            r["prompt_tokens_mean"] = sum(map(len, prompts)) / max(len(prompts), 1)
            if a.phases:   # one more run with a sync at every engine phase: where the step's wall time goes
                llm.engine.phase.reset(True)
                host = cProfile.Profile() if a.profile else None   # and which Python functions take the host time
                if host:
                    host.enable()
                ph = run(llm, prompts, a.max_tokens)
                if host:
                    host.disable()
                    write_host_profile(host, os.path.join(a.profile, f"phases-{style}-n{n}.txt"))
                r["phases"] = {"wall_s": ph["wall_s"], "steps": llm.engine.phase.calls.get("runner.run", 0),
                               "ms": llm.engine.phase.report()}
                llm.engine.phase.reset(False)
            if a.profile:
                os.makedirs(a.profile, exist_ok=True)
                r["profile"] = profile_steps(llm, prompts, 6 * (n + 1), os.path.join(a.profile, f"profile-{style}-n{n}.txt"),
                                             cached=a.prefix_cached)
            rows[n] = r
            print(f"{style:8s} n={n}: {r[speed]:8.1f} tok/s ({speed})  accepted length "
                  f"{r.get('spec_mean_accepted_length', 1.0):.2f}  identical={r['identical_to_baseline']}", flush=True)
            if "phases" in r:
                ph, steps = r["phases"], max(r["phases"]["steps"], 1)
                print(f"    phases (synced), ms per step over {steps} steps: " + "  ".join(
                    f"{k} {v['ms'] / steps:.2f}" for k, v in ph["ms"].items()), flush=True)
            if "profile" in r:
                pr = r["profile"]
                print(f"    profile, {pr['max_tokens']} tokens: GPU / host ms per phase: " + "  ".join(
                    f"{k} {v['gpu_ms']:.1f}/{v['host_ms']:.1f} ({v['calls']}x)" for k, v in pr["phases"].items())
                      + f"  launches {pr['launch_calls']}", flush=True)
            llm.shutdown()
            del llm
            gc.collect()   # the engine's reference cycles (CUDA graphs, caches) hold its GPU memory until then
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for n, r in rows.items():
            r["speedup_vs_n0"] = r[speed] / rows[0][speed]
        results["styles"][style] = rows
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
