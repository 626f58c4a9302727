"""`sketchkv bench agents`: N agents x L tokens of context decoding side by side, against the bytes-moved floor.

For each context L and number of agents N, and each configuration

    sparse   sketchkv sparse decode over the host tier (K/V in pinned host RAM, the GPU keeps the sketch,
             sinks + recent rows and a hot buffer)
    dense    sketchkv dense decode (paged bf16 KV on the GPU), where it fits: decided by memory arithmetic
             before anything is allocated (the capacity table says where dense stops)
    hf       Hugging Face transformers (the same config; fla on a GPU), where it fits (optional)

one point runs: a cold prefill of the N prompts (after an untimed two-chunk prompt: cold caches, compiled
kernels), all N agents decoding concurrently (--decode-tokens timed steps with every agent in the batch, CUDA
graphs), an optional per-layer-group breakdown of a few
eager steps (--breakdown), then a follow-up turn per agent (its conversation so far + --followup-tokens
new tokens, re-sent whole: the prefix cache serves it): first agent 0 alone, then the others together.

Reported per point: combined and per-agent decode tok/s; bytes one step must move (weights, GDN state
read + write, sketch, selected K/V rows; PCIe misses measured) and the fraction of the floor (those bytes
at the HBM bandwidth measured in the same run by a large device copy, plus the misses at the pinned
host-to-device bandwidth, see sketchkv/bench/floor.py); GPU and host bytes per agent (the engine's
accounting, next to the arithmetic); hot-buffer hit rate and PCIe bytes per step; cold prefill tok/s;
follow-up TTFT. Output: NAME.json, NAME.md, NAME.png (tok/s vs agents and vs context, floor dashed).
Every row carries the command that reproduces it.

Contexts: --fill real prefills every prompt through the engine (this is the cold prefill that is timed).
--fill random writes random K/V (through the tier's own quantising write), matching sketches and random GDN
state for the first L - --tail tokens of each agent directly into the caches, then prefills the last --tail
tokens for real: decode speed depends on the bytes a step reads, not on their values, and 8 x 250K real
prefills would not fit a 10-minute run. A random-weight model picks almost at random either way; the
bundled reference model (real text, --fill real) gives realistic selection and hot-buffer hit rates.

    sketchkv bench agents --model random:qwen3.5-27b --agents 8 --contexts 250K --configs sparse dense \\
        --fill random --breakdown --out-dir benchmarks/results
    sketchkv bench agents --agents 1 2 --contexts 1K 2K --decode-tokens 16 --device cpu   # CPU, reference model
    sketchkv bench agents --from-json a.json b.json --name agents-2026-12-01   # merge runs into one report

--data-parallel N [N ...] runs the points on N replica processes at once, one engine per GPU, and reports
the combined tok/s over their common timed window (see sketchkv/bench/data_parallel.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import shlex
import statistics
import sys
import time

from sketchkv.bench import data_parallel as DP
from sketchkv.config import flat_fields, resolved_host_residual_keys
from sketchkv.eval import common as C
from sketchkv.errors import SketchKVError

CONFIGS = ("sparse", "dense", "hf")
LABELS = {"sparse": "sketchkv sparse + host tier", "dense": "sketchkv dense", "hf": "transformers dense"}
SPEC_KNOBS = ("num_speculative_tokens", "mtp_attention_window")
SPARSE_KNOBS = ("sparse_top_k", "sparse_sink_tokens", "sparse_recent_tokens", "sparse_host_format",
                "sparse_hot_fraction", "sparse_host_budget_gb", "sparse_gpu_budget_gb", "sparse_basis",
                "sparse_head_combine", "sparse_score_kernel", "sparse_tier_kernel", "sparse_verify_selection",
                "sparse_prefill_selection", "sparse_admit_stream", "sparse_host_residual_keys", "sparse_read_groups",
                "sparse_miss_read", "sparse_softmax_lse_stride", "sparse_softmax_lse_min_samples")
LONG = 240_000  # "250K-class" contexts for the goal checks


LABEL_KNOBS = ("--sparse-host-format", "--sparse-head-combine", "--sparse-prefill-selection",
               "--sparse-host-residual-keys", "--no-sparse-host-residual-keys")   # named in words, or always spelled out


def label(config: str, host_format: str, head_combine: str = "softmax", knobs: tuple = ()) -> str:
    """A row's name in the reports: the sparse rows name their host format, a head combine other than the
    default, and `knobs` ((flag, value) pairs: a merged report's knobs that differ between its sparse rows)."""
    if config != "sparse":
        return LABELS[config]
    combine = "" if head_combine == "softmax" else f", {head_combine} combine"
    return LABELS[config] + f" ({host_format} rows{combine}" + "".join(f", {a} {b}".rstrip() for a, b in knobs) + ")"


def distinct_knobs(commands: list[str]) -> list[tuple]:
    """Per command, its engine knobs that not every command shares (and the label does not already name)."""
    sets = [[k for k in engine_knobs(c) if k[0].split("=")[0] not in LABEL_KNOBS] for c in commands]
    common = set.intersection(*map(set, sets)) if sets else set()
    return [tuple(k for k in ks if k not in common) for ks in sets]


def host_rows(fmt: str, residual_keys: bool) -> str:
    """The host format as the reports name it: int4 rows with residual keys (the default under the key sketch,
    since session 21) are "int4 residual-key", plain int4 stays "int4" (as in older reports)."""
    return fmt + (" residual-key" if residual_keys else "")


def row_host_rows(part: dict, row: dict) -> str:
    """host_rows of a saved sparse row: its file's format and residual keys (files before session 21 lack the
    field: their rows had them only when the command says so)."""
    sp = part["sparse"]
    residual = sp.get("residual_keys", ("--sparse-host-residual-keys", "") in engine_knobs(row.get("command", "")))
    return host_rows(sp["host_format"], residual)


def row_head_combine(part: dict, row: dict) -> str:
    """A saved sparse row's head combine: its file's (since session 23), else its command's flag, else the default."""
    knobs = dict(engine_knobs(row.get("command", "")))
    return part["sparse"].get("head_combine", knobs.get("--sparse-head-combine", "softmax"))


def parse_tokens(s: str) -> int:
    """'250K' -> 256000 (K = 1024), '4096' -> 4096."""
    t = s.strip().upper()
    try:
        return int(float(t[:-1]) * 1024) if t.endswith("K") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r} (e.g. 4096, 32K)") from None


def parse_agents(s: str):
    if s.strip().lower() == "max":
        return "max"
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of agents: {s!r} (an integer, or 'max')") from None
    if n < 1:
        raise argparse.ArgumentTypeError("agents must be >= 1")
    return n


def add_args(p: argparse.ArgumentParser) -> None:
    from sketchkv.config import default_model
    p.add_argument("--model", default=default_model(),
                   help="model directory, or random:PRESET (random:qwen3.5-27b: the 27B shape, random weights)")
    p.add_argument("--agents", type=parse_agents, nargs="+", default=[1, 2],
                   help="numbers of agents; 'max' = the most the sparse tier's memory budgets hold at that context")
    p.add_argument("--contexts", type=parse_tokens, nargs="+", default=[1024, 2048],
                   help="tokens of context per agent (K = 1024: 250K = 256000)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=["sparse", "dense"],
                   help="sparse (+ host tier), dense, hf (transformers; needs fla on a GPU)")
    p.add_argument("--decode-tokens", type=int, default=256, help="timed decode steps with every agent in the batch")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--followup-tokens", type=int, default=1024, help="new tokens of the follow-up turn")
    p.add_argument("--followup-decode", type=int, default=8, help="tokens generated in the follow-up turn")
    p.add_argument("--fill", choices=("real", "random"), default="real",
                   help="real: prefill every prompt (timed cold prefill); random: write random caches for all but "
                        "the last --tail tokens, prefill those")
    p.add_argument("--tail", type=int, default=1024, help="--fill random: tokens per agent prefilled for real")
    p.add_argument("--breakdown", action="store_true", help="time the layer groups over a few eager steps")
    p.add_argument("--breakdown-steps", type=int, default=4)
    p.add_argument("--text", nargs="*", default=None,
                   help="prompt text files/dirs (default: the model's held-out files, else its calibration/ "
                        "directory; random token ids for random:* models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hbm-gib", type=float, default=None, help="size of the bandwidth copy (default 4 GiB on a "
                                                              "GPU, 0.25 on a CPU)")
    p.add_argument("--hf-prefill-chunk", type=int, default=0, help="transformers: prefill in chunks (0: one forward)")
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    p.add_argument("--name", default=None, help="output file stem (default: agents-<date>)")
    p.add_argument("--from-json", nargs="+", metavar="JSON", help="run nothing: merge saved result files into "
                                                                   "--out-dir/--name (.json, .md, .png)")
    p.add_argument("--data-parallel", type=int, nargs="+", metavar="N", default=None,
                   help="run every point on N replica processes at once (one engine per GPU, each with --agents "
                        "agents; on a CPU, N processes sharing the cores) and report the combined tok/s over their "
                        "common timed window; several values (e.g. 1 2) also give the ratio to one replica. "
                        "--sparse-host-budget-gb is per replica (default: half the available RAM, split)")
    p.add_argument("--quiet", action="store_true")
    add_reference_accepted_length(p)
    add_engine_args(p)


def add_reference_accepted_length(p: argparse.ArgumentParser) -> None:
    """--reference-accepted-length (bench agents, bench step)."""
    p.add_argument("--reference-accepted-length", type=float, default=None, metavar="L",
                   help="with --num-speculative-tokens on a random-weight model (its drafts are rejected, so every "
                        "step verifies n drafts and keeps one token): also report agents x L / measured step time, "
                        "L = the mean accepted length measured on a trained model (benchmarks/bench_mtp.py)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags a benchmark point takes (base options + sparse and speculative knobs; `bench step` too)."""
    from sketchkv.config import add_dataclass_args
    keep = set(C.BASE_OPTIONS) | set(SPARSE_KNOBS) | set(SPEC_KNOBS)
    g = p.add_argument_group("engine options (every sketchkv configuration)")
    add_dataclass_args(g, skip=tuple(n for n, _, _ in flat_fields() if n not in keep))


def main(args: argparse.Namespace) -> dict:
    name = args.name or f"agents-{datetime.date.today().isoformat()}"
    if args.from_json:
        return merge(args.from_json, args.out_dir, name)
    if args.data_parallel:
        if min(args.data_parallel) < 1:
            raise SketchKVError("--data-parallel values must be >= 1")
        return DP.run(args, name, __name__)
    return run(args, name)


# ----------------------------------------------------------------------------------------------------------
# Commands that reproduce one point
# ----------------------------------------------------------------------------------------------------------
POINT_FLAGS = ("--agents", "--contexts", "--configs", "--out-dir", "--name", "--from-json")


def argv_without(argv: list[str], flags=POINT_FLAGS) -> list[str]:
    out, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a.split("=")[0] in flags
            if skip:
                continue
        elif skip:
            continue
        out.append(a)
    return out


def point_command(argv: list[str], config: str, agents: int, context: int, prefill_selection: str | None = None,
                  residual_keys: bool | None = None) -> str:
    """The command that measures one point. The sparse engine's knobs resolved from `auto` (prefill_selection,
    residual_keys) are spelled out when argv leaves them to the default, so the command means the same after a
    default changes and a merged report keeps such rows apart (engine_knobs)."""
    rest = argv_without(argv)
    given = {a.split("=")[0] for a in rest}
    if prefill_selection and "--sparse-prefill-selection" not in given:
        rest += ["--sparse-prefill-selection", prefill_selection]
    if residual_keys is not None and not given & {"--sparse-host-residual-keys", "--no-sparse-host-residual-keys"}:
        rest += ["--sparse-host-residual-keys" if residual_keys else "--no-sparse-host-residual-keys"]
    return "sketchkv bench agents " + " ".join(shlex.quote(a) for a in rest + [
        "--configs", config, "--agents", str(agents), "--contexts", str(context)])


# ----------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------
def token_stream(model: str, paths: list[str] | None, need: int) -> tuple[list[int] | None, str]:
    """Token ids of real text for a model with a tokenizer (None: use random ids), and where they came from:
    about 2 x `need` tokens (agents take rotated windows of it)."""
    if model.startswith("random:"):
        return None, "random token ids"
    from sketchkv.models.tokenizer import Tokenizer
    docs, source = None, None
    try:
        docs, src = C.load_documents(paths or [], model)
        source = (f"held-out files of {src['heldout_json']}" if src.get("heldout_json")
                  else ", ".join(src.get("paths", [])))
    except SketchKVError:  # no held-out files here: the calibration text shipped with the model
        calib = os.path.join(model, "calibration")
        if not paths and os.path.isdir(calib):
            docs = [C.Doc(f, f, t) for f in sorted(os.listdir(calib))
                    if (t := C._read(os.path.join(calib, f))) is not None]
            source = calib
    if not docs:
        return None, "random token ids"
    tok = Tokenizer(model)
    text, ids, budget = "", [], min(32 * 2**20, max(2**18, 8 * need))
    for d in docs:
        text += C.FILE_HEADER.format(rel=d.rel) + d.text
        if len(text) > budget:
            break
    ids = tok.encode(text)
    return ids, f"{source} ({len(ids)} tokens, repeated and rotated per agent)"


def make_ids(stream: list[int] | None, n: int, offset: int, vocab: int, seed: int) -> list[int]:
    if stream is None:
        import torch
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, max(4, min(vocab, 32000)), (n,), generator=g).tolist()
    offset %= len(stream)
    reps = -(-(offset + n) // len(stream))
    return (stream * reps)[offset:offset + n]


_POINTS = [0]


def agent_prompts(stream, n: int, L: int, args, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each point's own prompts (never a prefix-cache hit on an earlier point: the prefill is cold) and
    follow-up messages, one per agent."""
    _POINTS[0] += 1
    k = _POINTS[0] * 1009 + args.seed * 100003
    prompts = [make_ids(stream, L, 104729 * (i + 1) + 7919 * k, vocab, k * 1000 + i) for i in range(n)]
    msgs = [make_ids(stream, args.followup_tokens, 15485863 * (i + 1) + 31 * k, vocab, k * 1000 + 500 + i)
            for i in range(n)]
    return prompts, msgs


# ----------------------------------------------------------------------------------------------------------
# Random contexts (--fill random)
# ----------------------------------------------------------------------------------------------------------
def fill_random(eng, seq, filled: int, gen) -> None:
    """Give a waiting sequence a state slot, a hot partition and `filled` tokens of random cache, as if
    its first `filled` tokens had been prefilled; the scheduler then prefills the rest."""
    import torch
    from sketchkv.errors import CapacityError
    from sketchkv.layers.sparse_attention import SparseAttention
    from sketchkv.ops.sketch import sketch_write
    r, sch = eng.runner, eng.scheduler
    if not sch.free_slots:
        raise CapacityError("no free state slot for a filled agent (raise max_num_seqs)")
    if r.tier is not None and not r.tier.can_add(seq):
        raise CapacityError(f"no hot-buffer rows for agent {seq.request_id}")
    if not eng.blocks.can_grow(seq, filled):
        raise CapacityError(f"{filled} tokens do not fit the KV blocks left ({eng.blocks.num_free} free)")
    seq.state_slot = sch.free_slots.popleft()
    if r.tier is not None:
        r.tier.add(seq)
    eng.blocks.grow(seq, filled)
    dev, bs = r.device, r.block_size
    c = eng.model_config
    table = torch.tensor(seq.block_table, dtype=torch.int64, device=dev)
    chunk = 16384
    for start in range(0, filled, chunk):
        p = torch.arange(start, min(filled, start + chunk), device=dev)
        slots = table[p // bs] * bs + p % bs
        for m in r.attn_layers:
            k = torch.randn(len(p), c.num_kv_heads, c.head_dim, device=dev, generator=gen).to(r.dtype)
            v = torch.randn(len(p), c.num_kv_heads, c.head_dim, device=dev, generator=gen).to(r.dtype)
            if isinstance(m, SparseAttention):   # first: residual host keys are taken against the sketch
                sketch_write(k, m.mean, m.basis, m.sketch, m.sketch_scale, slots)
            if m in r.tier_layers:
                r.tier.store.write(m.layer, slots, r.tier.host_keys(m.layer, slots, k), v)
            else:
                m.k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, k)
                m.v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, v)
    for m in r.qsa_layers:  # qwen4_exp: random (unit-scale, like RMSNormed) block keys for the filled blocks;
        # `filled` is a multiple of the block size, hence of the compress ratio: the raw index tail stays empty
        first = torch.arange(0, filled, m.ratio, device=dev)
        rows = m.key_rows(table[None].int(), first[None])[0]
        keys = torch.randn(len(first), m.index_dim, device=dev, generator=gen).to(m.index_keys.dtype)
        m.index_keys.index_copy_(0, rows, keys)
    for m in r.gdn_layers:
        m.conv_state[seq.state_slot].normal_(0, 0.1, generator=gen)
        m.ssm_state[seq.state_slot].normal_(0, 0.01, generator=gen)
    if r.state_layers:  # other per-sequence state (qwen4_exp PLE n-gram context): start empty
        slot = torch.tensor([seq.state_slot], device=dev)
        for m in r.state_layers:
            m.reset_state(slot)
    seq.num_cached = filled
    if r.tier is not None:
        r.tier.store.synchronize()


# ----------------------------------------------------------------------------------------------------------
# One point on a sketchkv engine
# ----------------------------------------------------------------------------------------------------------
def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def turn1_max_tokens(args, n: int, prefill_tokens: int, chunk: int) -> int:
    """Turn-1 tokens per agent: enough for the timed window after every agent has prefilled (agents that
    finish prefill early decode in the meantime, at most one token per step)."""
    mixed = -(-n * prefill_tokens // max(1, chunk)) + n + 2
    per_step = 1 + int(getattr(args, "num_speculative_tokens", None) or 0)   # a verification step keeps up to 1 + n
    return 1 + per_step * (args.warmup_steps + args.decode_tokens + (args.breakdown_steps if args.breakdown else 0)) + mixed


def run_point(llm, config: str, n: int, L: int, args, stream, shape, bw: dict) -> dict:
    import torch
    from sketchkv.bench import floor as F
    from sketchkv.bench.breakdown import measure, profile_kernels
    from sketchkv.sampling_params import SamplingParams
    eng = llm.engine
    dev, r, sp = eng.device, eng.runner, eng.cfg.sparse
    vocab = eng.model_config.vocab_size
    bs = r.block_size
    filled = fill_tokens(args, L, bs)
    chunk = eng.cfg.scheduler.max_num_batched_tokens
    max_tokens = turn1_max_tokens(args, n, L - filled, chunk)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    need = n * -(-(L + max_tokens) // bs)
    if need > eng.blocks.num_blocks - 1:  # the engine's real KV / host-tier size (the arithmetic was an estimate)
        from sketchkv.errors import CapacityError
        raise CapacityError(f"{n} agents need {need} KV blocks, the engine has {eng.blocks.num_blocks - 1}")
    prompts, msgs = agent_prompts(stream, n, L, args, vocab)
    if L - filled > chunk:
        warm_prefill(llm, vocab, min(L, 2 * chunk + bs), args.seed)
    seqs, prefill = prefill_agents(eng, prompts, filled, params, args.fill, args.seed)
    # ---- decode window: every agent in the batch
    assert len(eng.scheduler.running) == n and not eng.scheduler.waiting, "not every agent is decoding"
    for _ in range(args.warmup_steps):
        eng.step()
    per_seq = llm.tier_stats(per_sequence=True) if r.tier is not None else {}
    lens0 = [len(s) for s in seqs]
    tier0 = llm.tier_stats()
    spec0 = r.spec.metrics() if r.spec is not None else None
    DP.window_barrier()   # data-parallel replicas start their windows together
    window0 = time.time()
    times, tokens, ctx_mean = time_steps(eng, seqs, args.decode_tokens)
    window = [window0, time.time()]   # wall clock: comparable across replica processes
    tier1 = llm.tier_stats()
    nsteps = len(times)
    step_s = sum(times) / nsteps
    decode = {"steps": nsteps, "step_ms_mean": 1e3 * step_s, "step_ms_p50": 1e3 * statistics.median(times),
              "step_ms_max": 1e3 * max(times), "tok_s": tokens / sum(times), "per_agent_tok_s": tokens / n / sum(times),
              "context_mean": ctx_mean, "graphs": bool(r.graphs), "window": window}
    if spec0 is not None:
        spec1 = r.spec.metrics()
        v = spec1["spec_verifications"] - spec0["spec_verifications"]
        acc = spec1["spec_accepted_tokens"] - spec0["spec_accepted_tokens"]
        decode["speculative"] = {
            "num_speculative_tokens": r.spec.num_tokens, "verifications": v,
            # what speculation adds: the MTP K/V (with the windowed drafter its ring, counted in the per-agent GPU
            # bytes too, as per-slot state) and the GDN verification inputs
            "extra_gpu_bytes_per_agent": r.spec.bytes_per_seq(round(ctx_mean)),
            "mean_accepted_length": (acc + v) / v if v else None, "verification_graphs": bool(r.verify_graphs),
            "reference_accepted_length": args.reference_accepted_length,
            "projected_tok_s": n * args.reference_accepted_length / step_s if args.reference_accepted_length else None}
    tier, pcie = tier_window(r, tier0, tier1, nsteps)
    b, floor = step_floor(shape, sp, config, n, ctx_mean, pcie, tier0 is not None, bw, step_s)
    # ---- memory per agent: the engine's accounting and the arithmetic
    if config == "sparse":
        gpu_agent = statistics.fmean(per_seq[s.request_id].gpu_bytes for s in seqs) + r.state_bytes_per_seq
        host_agent = statistics.fmean(per_seq[s.request_id].host_bytes for s in seqs)
    else:
        gpu_agent = statistics.fmean(len(s.block_table) for s in seqs) * r.kv_bytes_per_block + r.state_bytes_per_seq
        host_agent = 0.0
    tokens = round(statistics.fmean(lens0))
    arith = F.agent_bytes(shape, config, tokens, sp.sink_tokens, sp.recent_tokens, sp.hot_fraction, sp.host_format,
                          hot_tokens=round(statistics.fmean(len(s.prompt_token_ids) for s in seqs)) + max_tokens,
                          slot_bytes=r.tier.hot.map.element_size() if r.tier is not None else 4,
                          mtp_rows=F.mtp_kv_rows(tokens, r.num_spec, r.cfg.mtp_attention_window, r.block_size),
                          num_speculative_tokens=r.num_spec)
    memory = {"gpu_bytes_per_agent": gpu_agent, "host_bytes_per_agent": host_agent,
              "gpu_bytes_per_agent_arith": arith["gpu"], "host_bytes_per_agent_arith": arith["host"],
              "tokens_per_agent": statistics.fmean(lens0)}
    if dev.type == "cuda":
        memory["gpu_bytes_peak_process"] = torch.cuda.max_memory_allocated(dev)
    # ---- breakdown
    bd = None
    if args.breakdown:
        bd = profile_kernels(eng, args.breakdown_steps) if dev.type == "cuda" else measure(eng, args.breakdown_steps)
        bd["graph_step_ms"] = decode["step_ms_mean"]
        bd["bytes"] = {"weights": b["weights"], "gdn": b["gdn_state"], "selection": b["sketch"], "attention": b["kv"],
                       "pcie_misses": b["pcie"]}
    # ---- follow-up turn: agent 0 alone, then the others together. First, untimed, a warm-up turn on agent
    # 0's conversation with another message (its reversal: no 64-token block of it matches the real one): it
    # compiles / autotunes the follow-up path's kernels (first use: ~11 s on a fresh H200, run 7; 13.8 s in
    # run 44's 1 x 128K), a one-time cost of the process, not of a turn.
    for s in seqs:
        eng.abort(s.request_id)
    fu = {"tokens_added": args.followup_tokens, "decode_tokens": args.followup_decode}
    fparams = SamplingParams(temperature=0, max_tokens=max(1, args.followup_decode), ignore_eos=True)
    conv = [list(s.token_ids) + m for s, m in zip(seqs, msgs)]
    warm = list(seqs[0].token_ids) + msgs[0][::-1]
    turns = [[warm], conv[:1]] + ([conv[1:]] if n > 1 else [])   # warm-up, agent 0, the others at once
    ttft, cached, prompt_len = [], [], []
    for turn in turns:
        _sync(dev)
        fs = [eng.add_request(ids, fparams) for ids in turn]
        while not all(s.first_token_time is not None for s in fs):
            eng.step()
        _sync(dev)
        ttft.append([s.first_token_time - s.arrival for s in fs])
        cached += [s.num_prompt_cached for s in fs]
        prompt_len += [s.num_prompt_tokens for s in fs]
        while eng.has_unfinished:
            eng.step()
    ttft, cached, prompt_len = ttft[1:], cached[1:], prompt_len[1:]   # drop the warm-up turn
    fu.update(ttft_s=ttft[0][0], ttft_concurrent_mean_s=statistics.fmean(ttft[1]) if n > 1 else None,
              ttft_concurrent_max_s=max(ttft[1]) if n > 1 else None, concurrent_agents=len(ttft[1]) if n > 1 else 0,
              cached_tokens_mean=statistics.fmean(cached), prompt_tokens_mean=statistics.fmean(prompt_len))
    for rid in list(eng.requests):
        eng.abort(rid)
    return {"decode": decode, "bytes_per_step": b, "floor": floor, "memory": memory, "tier": tier,
            "prefill": prefill, "followup": fu, "breakdown": bd}


def time_steps(eng, seqs: list, steps: int) -> tuple[list[float], int, float]:
    """`steps` decode steps of every agent, each between device syncs -> (seconds per step, tokens generated, the
    mean context at a step: tokens cached, averaged over the steps)."""
    n, lens0, times = len(seqs), [len(s) for s in seqs], []
    for _ in range(steps):
        _sync(eng.device)
        t = time.perf_counter()
        eng.step()
        _sync(eng.device)
        times.append(time.perf_counter() - t)
        if len(eng.scheduler.running) != n:
            raise RuntimeError("an agent stopped inside the timed steps")
    tokens = sum(len(s) for s in seqs) - sum(lens0)              # > n per step when drafts are accepted
    return times, tokens, statistics.fmean(lens0) + (tokens / n - 1) / 2


def tier_window(runner, tier0, tier1, steps: int) -> tuple[dict | None, float]:
    """The host tier's counters over `steps` steps (tier_stats before, after) -> (per-step rates, PCIe read bytes
    per step); (None, 0) without a tier."""
    if tier0 is None:
        return None, 0.0
    hits, misses = tier1.hits - tier0.hits, tier1.misses - tier0.misses
    pcie = (tier1.pcie_read_bytes - tier0.pcie_read_bytes) / steps
    return {"hits_per_step": hits / steps, "misses_per_step": misses / steps,
            "hit_rate": hits / max(1, hits + misses), "pcie_read_bytes_per_step": pcie,
            "pcie_write_bytes_per_step": (tier1.pcie_write_bytes - tier0.pcie_write_bytes) / steps,
            "host_row_bytes": runner.tier.store.row_bytes, "host_bytes_allocated": tier1.host_bytes,
            "gpu_bytes_allocated": tier1.gpu_bytes}, pcie


def fill_tokens(args, L: int, block_size: int) -> int:
    """Tokens per agent that --fill random writes directly (whole blocks, all but the last --tail); 0 for real."""
    return 0 if args.fill == "real" else max(0, (L - max(args.tail, block_size)) // block_size * block_size)


def warm_prefill(llm, vocab: int, tokens: int, seed: int) -> None:
    """An untimed prompt of two chunks and a bit (random ids, one output token) before the timed cold prefill, which
    then measures a cold prefix cache, not the first compiles of what a chunk over a long prefix runs (Triton's JIT:
    chunk selection, the prefix rows' reads; the engine's own warm-up prefill is one chunk without a prefix). H200
    run 117: the first of two processes on a fresh machine paid them and measured its prefill 25% below the other's."""
    import torch
    from sketchkv.sampling_params import SamplingParams
    ids = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))


def prefill_agents(eng, prompts: list[list[int]], filled: int, params, fill: str, seed: int) -> tuple[list, dict]:
    """Add one request per prompt (the first `filled` tokens of each from random caches), prefill the rest until
    every agent has its first token -> (sequences, the prefill's timings)."""
    import torch
    dev = eng.device
    chunk = eng.cfg.scheduler.max_num_batched_tokens
    n, L = len(prompts), len(prompts[0])
    gen = torch.Generator(device=dev).manual_seed(seed)
    # ---- cold prefill
    _sync(dev)
    t0 = time.perf_counter()
    seqs = []
    for ids in prompts:
        seq = eng.add_request(ids, params)
        if filled:
            fill_random(eng, seq, filled, gen)
        seqs.append(seq)
    _sync(dev)
    t_fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps = 0
    # the cold prefill at full speed: no decode-only steps for agents that finished theirs (the engine's
    # decode_time_share), so those decode at most one token per prefill step, as turn1_max_tokens counts
    share, eng.scheduler.cfg.decode_time_share = eng.scheduler.cfg.decode_time_share, 0.0
    try:   # the engine serves the next points too
        while not all(s.output_token_ids for s in seqs):
            cached = sum(s.num_cached for s in seqs)
            # a prompt chunk step returns no outputs (partly prefilled sequences are not "running" yet):
            # progress is tokens cached or tokens out
            if not eng.step() and sum(s.num_cached for s in seqs) == cached:
                raise RuntimeError("the engine made no progress during prefill")
            steps += 1
    finally:
        eng.scheduler.cfg.decode_time_share = share
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    prefill = {"mode": fill, "filled_tokens_per_agent": filled, "fill_seconds": t_fill,
               "tokens": n * (L - filled), "seconds": prefill_s, "tok_s": n * (L - filled) / prefill_s,
               "steps": steps, "chunk": chunk}
    return seqs, prefill


def step_floor(shape, sp, config: str, n: int, ctx_mean: float, pcie: float, tiered: bool, bw: dict,
               step_s: float) -> tuple[dict, dict]:
    """-> (bytes one step must move, its floor: seconds at the run's bandwidths, tok/s, fraction of step_s)."""
    from sketchkv.bench import floor as F
    selected = sp.sink_tokens + sp.top_k + sp.recent_tokens
    b = F.step_bytes(shape, config == "sparse", n, ctx_mean, selected, pcie,
                     resident=sp.sink_tokens + sp.recent_tokens, host_format=sp.host_format if tiered else None)
    fl = F.floor_seconds(b, bw["hbm"], bw["pcie"] or bw["hbm"])
    return b, dict(fl, tok_s=n / fl["total_s"], fraction=fl["total_s"] / step_s,
                   fraction_hbm_only=fl["hbm_s"] / step_s, ms=1e3 * fl["total_s"])


# ----------------------------------------------------------------------------------------------------------
# Transformers
# ----------------------------------------------------------------------------------------------------------
def load_hf(model: str, device, dtype):
    import torch
    if device.type != "cuda" and "fla" not in sys.modules:
        sys.modules["fla"] = None  # fla's kernels cannot take CPU tensors: transformers falls back to PyTorch
    import transformers
    if model.startswith("random:"):
        from sketchkv.models.presets import PRESETS
        raw = dict(PRESETS[model[len("random:"):]])
        mtype = raw.pop("model_type")
        if mtype != "qwen3_5_text":
            raise ValueError(f"hf: preset model type {mtype} not wired")
        cfg = transformers.Qwen3_5TextConfig(**raw)
        prev = torch.get_default_dtype()
        with torch.device(device):
            torch.set_default_dtype(dtype)
            try:
                hf = transformers.Qwen3_5ForCausalLM(cfg).eval()
            finally:
                torch.set_default_dtype(prev)
        return hf
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


def run_hf_point(hf, n: int, L: int, args, stream, shape, bw: dict, vocab: int, device) -> dict:
    import torch
    from sketchkv.bench import floor as F
    prompts, msgs = agent_prompts(stream, n, L, args, vocab)
    ids, msgs = torch.tensor(prompts, device=device), torch.tensor(msgs, device=device)
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        cache = None
        step = args.hf_prefill_chunk or L
        for s in range(0, L, step):
            out = hf(ids[:, s:s + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
        _sync(device)
        pre = time.perf_counter() - t0
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for i in range(args.warmup_steps + args.decode_tokens):
            _sync(device)
            t0 = time.perf_counter()
            out = hf(tok, past_key_values=out.past_key_values, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            if i >= args.warmup_steps:
                times.append(time.perf_counter() - t0)
        _sync(device)
        t0 = time.perf_counter()
        out = hf(msgs, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1).tolist()
        ttft = time.perf_counter() - t0
    del out, cache
    step_s = sum(times) / len(times)
    ctx_mean = L + args.warmup_steps + (len(times) + 1) / 2
    b = F.step_bytes(shape, False, n, ctx_mean)
    fl = F.floor_seconds(b, bw["hbm"], bw["pcie"] or bw["hbm"])
    return {"decode": {"steps": len(times), "step_ms_mean": 1e3 * step_s, "step_ms_p50": 1e3 * statistics.median(times),
                       "step_ms_max": 1e3 * max(times), "tok_s": n / step_s, "per_agent_tok_s": 1 / step_s,
                       "context_mean": ctx_mean, "graphs": False},
            "bytes_per_step": b,
            "floor": dict(fl, tok_s=n / fl["total_s"], fraction=fl["total_s"] / step_s,
                          fraction_hbm_only=fl["hbm_s"] / step_s, ms=1e3 * fl["total_s"]),
            "memory": {"gpu_bytes_per_agent_arith": F.agent_bytes(shape, "hf", L)["gpu"], "host_bytes_per_agent": 0.0},
            "tier": None,
            "prefill": {"mode": "real", "tokens": n * L, "seconds": pre, "tok_s": n * L / pre,
                        "chunk": args.hf_prefill_chunk or L},
            "followup": {"tokens_added": args.followup_tokens, "ttft_s": ttft, "concurrent_agents": 0,
                         "note": "all agents in one batch; the cache is kept (no re-sent prefix)"},
            "breakdown": None}


# ----------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------
def capacity(shape, config: str, L: int, extra: int, budget: dict, sp, cfg=None) -> dict:
    """cfg: the run's EngineConfig (speculation: the drafter's K/V; transformers runs without it)."""
    from sketchkv.bench import floor as F
    n = cfg.num_speculative_tokens if cfg is not None and config != "hf" else 0
    mtp = F.mtp_kv_rows(L + extra, n, cfg.mtp_attention_window, shape.block_size) if n else 0
    per = F.agent_bytes(shape, "hf" if config == "hf" else config, L + extra, sp.sink_tokens, sp.recent_tokens,
                        sp.hot_fraction, sp.host_format, mtp_rows=mtp, num_speculative_tokens=n)
    if config == "hf":  # one forward over N x L tokens: its activations scale with the agents
        per = dict(per, gpu=per["gpu"] + F.activation_estimate(shape, L))
    return {"per_agent_gpu": per["gpu"], "per_agent_host": per["host"],
            "max_agents": F.max_agents(per, budget, config)}


def engine_base(args) -> dict:
    """The engine options the command line sets (base options, sparse and speculative knobs), parsed."""
    base = {**C.base_options(args), **{k: v for k in SPARSE_KNOBS + SPEC_KNOBS
                                       if (v := getattr(args, k, None)) is not None}}
    return {k: (C._parse_value(v, C._flat_fields()[k]) if isinstance(v, str) else v) for k, v in base.items()}


def engine_options(args, base: dict, config: str, agents: int, max_len: int, shape) -> dict:
    """LLM(...) keywords of a sparse or dense engine for `agents` sequences of up to max_len tokens."""
    opts = dict(base, max_num_seqs=agents, max_model_len=max_len,
                sparse=config == "sparse", sparse_host_tier=config == "sparse")
    if getattr(args, "state_cache_gb", None) is None:
        opts["state_cache_gb"] = max(8.0, 4 * agents * shape.gdn_state / 2**30)
    return opts


def run(args, name: str, write: bool = True) -> dict:
    """Every point; write=False: only return the results (a data-parallel replica)."""
    import torch
    from sketchkv.bench import floor as F
    from sketchkv.config import build_config, resolved_prefill_selection
    from sketchkv.engine.llm_engine import resolve_device, resolve_dtype
    from sketchkv.errors import SketchKVError
    from sketchkv.llm import LLM
    base = engine_base(args)
    cfg0 = build_config(model=args.model, **base)
    dev = resolve_device(cfg0.device)
    dtype = resolve_dtype(cfg0.dtype, dev)
    sp = cfg0.sparse
    prefill_selection = resolved_prefill_selection(dataclasses.replace(sp, sparse=True, host_tier=True))
    shape = F.shape_of(args.model, dtype, cfg0.cache.block_size, sp.basis)
    mcfg = model_config(args.model)
    max_pos = mcfg.max_position_embeddings
    log = lambda m: C.log(DP.HOOK["prefix"] + m, args.quiet)  # noqa: E731
    gib = args.hbm_gib if args.hbm_gib is not None else (4.0 if dev.type == "cuda" else 0.25)
    bw = {"hbm": F.hbm_bandwidth(dev, gib), "pcie": F.pcie_bandwidth(dev, min(gib, 1.0))}
    log(f"bandwidth: HBM copy {bw['hbm'] / 1e9:.1f} GB/s" + (f", pinned H2D {bw['pcie'] / 1e9:.1f} GB/s"
                                                              if bw["pcie"] else " (CPU: host tier = main memory)"))
    budget = F.budgets(dev, shape, {**base, "max_num_batched_tokens": cfg0.scheduler.max_num_batched_tokens})
    contexts = sorted(set(args.contexts))
    chunk = cfg0.scheduler.max_num_batched_tokens
    extra_fu = args.followup_tokens + args.followup_decode + cfg0.cache.block_size
    caps = {}
    for cfgname in args.configs:
        for L in contexts:
            ex = turn1_max_tokens(args, 8, L, chunk) + extra_fu  # turn-1 growth (a typical N) + the follow-up
            caps[(cfgname, L)] = capacity(shape, cfgname, L, ex, budget, sp, cfg0)
    info = C.run_info(args.model, base)
    argv = sys.argv[sys.argv.index("agents") + 1:] if "agents" in sys.argv else []
    argv = argv_without(argv, ("--data-parallel",))   # a replica's rows: one engine, one GPU
    if "agents" in sys.argv:
        info["command"] = "sketchkv bench agents " + " ".join(shlex.quote(a) for a in argv)
    stream, source = token_stream(args.model, args.text, max(contexts) + args.followup_tokens)
    residual_keys = resolved_host_residual_keys(dataclasses.replace(sp, sparse=True, host_tier=True),
                                                sketch_selector=not mcfg.indexer_n_heads)
    rows_name = host_rows(sp.host_format, residual_keys)
    results = {"info": info, "model": args.model, "shape": shape.to_dict(), "bandwidth": bw, "budget": budget,
               "text": source, "sparse": {"top_k": sp.top_k, "sink_tokens": sp.sink_tokens,
                                          "recent_tokens": sp.recent_tokens, "host_format": sp.host_format,
                                          "hot_fraction": sp.hot_fraction, "prefill_selection": prefill_selection,
                                          "residual_keys": residual_keys, "head_combine": sp.head_combine},
               "capacity": [{"config": c, "context": L, "host_format": rows_name, **v}
                            for (c, L), v in caps.items()],
               "rows": []}
    out_paths = None
    for cfgname in args.configs:
        points = []
        for L in contexts:
            for a in args.agents:
                n = caps[(cfgname, L)]["max_agents"] if a == "max" and cfgname == "sparse" else a
                if a == "max" and cfgname != "sparse":
                    n = caps[(cfgname, L)]["max_agents"]
                points.append((L, a, n))
        def row0(L, a, n):
            cmd = point_command(argv, cfgname, n if a != "max" else "max", L,
                                *((prefill_selection, residual_keys) if cfgname == "sparse" else ()))
            return {"config": cfgname, "label": label(cfgname, rows_name, sp.head_combine),
                    "agents": n, "agents_arg": a, "context": L, "command": cmd}
        runnable, llm, hf = [], None, None
        for L, a, n in points:
            cap = caps[(cfgname, L)]
            if n < 1 or n > cap["max_agents"]:
                what = {"sparse": "host tier + GPU budgets", "dense": "the GPU KV budget", "hf": "GPU memory"}[cfgname]
                reason = (f"{n} x {C.fmt_len(L)} does not fit {what}: {cap['max_agents']} agents at this context "
                          f"({cap['per_agent_gpu'] / 2**30:.2f} GiB GPU" +
                          (f", {cap['per_agent_host'] / 2**30:.2f} GiB host" if cap["per_agent_host"] else "") +
                          " per agent)")
                results["rows"].append({**row0(L, a, n), "status": "skipped", "reason": reason})
                log(f"{cfgname} {n} x {L}: skipped ({reason})")
                continue
            if L + turn1_max_tokens(args, n, L, chunk) + extra_fu > max_pos:
                reason = f"context + turn-1 tokens + follow-up exceed the model's {max_pos} positions"
                results["rows"].append({**row0(L, a, n), "status": "skipped", "reason": reason})
                continue
            runnable.append((L, a, n))
        if not runnable:
            continue
        try:
            if cfgname == "hf":
                hf = load_hf(args.model, dev, dtype)
            else:
                nmax = max(n for _, _, n in runnable)
                lmax = max(L + turn1_max_tokens(args, n, L, chunk) for L, _, n in runnable) + extra_fu
                opts = engine_options(args, base, cfgname, nmax, min(max_pos, lmax), shape)
                log(f"{cfgname}: building the engine for up to {nmax} agents x {lmax} tokens")
                llm = LLM(args.model, **opts)
        except (SketchKVError, torch.OutOfMemoryError, ValueError, ImportError) as e:
            for L, a, n in runnable:
                results["rows"].append({**row0(L, a, n), "status": "error", "reason": f"{type(e).__name__}: {e}"})
            log(f"{cfgname}: {type(e).__name__}: {e}")
            continue
        for L, a, n in runnable:
            log(f"{cfgname}: {n} agents x {L} tokens")
            try:
                if cfgname == "hf":
                    res = run_hf_point(hf, n, L, args, stream, shape, bw, mcfg.vocab_size, dev)
                else:
                    res = run_point(llm, cfgname, n, L, args, stream, shape, bw)
                row = {**row0(L, a, n), "status": "ok", "bandwidth": bw, **res}
                d, f = res["decode"], res["floor"]
                log(f"  decode {d['tok_s']:.1f} tok/s combined ({d['step_ms_mean']:.2f} ms/step), floor "
                    f"{f['ms']:.2f} ms ({f['fraction']:.0%}); prefill {res['prefill']['tok_s']:.0f} tok/s; "
                    f"follow-up TTFT {res['followup']['ttft_s']:.3f} s")
            except (SketchKVError, torch.OutOfMemoryError, RuntimeError, AssertionError) as e:
                row = {**row0(L, a, n), "status": "error", "reason": f"{type(e).__name__}: {e}"}
                log(f"  error: {row['reason']}")
                DP.abort_barrier()
                if llm is not None:
                    for rid in list(llm.engine.requests):
                        llm.engine.abort(rid)
            results["rows"].append(row)
            if write:
                C.save_partial(results, args.out_dir, name)
            gc.collect()
        if llm is not None:
            C.release(llm)
            llm = None
        if hf is not None:
            del hf
            hf = None
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    results["goals"] = goals(results["rows"])
    if write:
        out_paths = C.write_outputs(results, args.out_dir, name, markdown, plot)
        log(f"wrote {out_paths['md']}, {out_paths['json']}, {out_paths['png']}")
    return results


def model_config(model: str):
    from sketchkv.models.loader import load_config
    from sketchkv.models.presets import preset_config
    return preset_config(model[len("random:"):])[0] if model.startswith("random:") else load_config(model)


# ----------------------------------------------------------------------------------------------------------
# Goals (issue 8), checked when the run has the rows
# ----------------------------------------------------------------------------------------------------------
def goals(rows: list[dict], dp_rows: list[dict] = ()) -> list[dict]:
    ok = [r for r in rows if r.get("status") == "ok"]
    def pick(c, n=None, lo=0, hi=10**9):
        return [r for r in ok if r["config"] == c and (n is None or r["agents"] == n) and lo <= r["context"] <= hi]

    def knobs(r):  # a merged report can hold the same point under other engine flags
        tag = " ".join(f"{a} {b}".strip() for a, b in engine_knobs(r.get("command", "")))
        return f" [{tag}]" if tag else ""
    out = []
    for r in pick("sparse", 8, LONG):
        out.append({"goal": "8 x 250K: combined decode >= 85% of the bytes-moved floor" + knobs(r),
                    "value": f"{r['floor']['fraction']:.0%} ({r['decode']['tok_s']:.0f} tok/s)",
                    "met": r["floor"]["fraction"] >= 0.85})
    for r in pick("sparse", 1, 120_000, 140_000):
        for other, k in (("hf", 8.0), ("dense", 1.3)):
            for o in pick(other, 1, r["context"], r["context"]):
                x = r["decode"]["tok_s"] / o["decode"]["tok_s"]
                out.append({"goal": f"1 x {C.fmt_len(r['context'])}: sparse >= {k}x {LABELS[other]}",
                            "value": f"{x:.2f}x", "met": x >= k})
    long = pick("sparse", None, LONG)
    held = [r for r in long if r.get("agents_arg") == "max"]   # only --agents max asks what the budgets hold
    if held:
        r = max(held, key=lambda r: r["agents"])
        out.append({"goal": "largest N x 250K held", "value": f"{r['agents']} agents, {r['decode']['tok_s']:.0f} tok/s",
                    "met": None})
    for r in long:
        if r["prefill"]["mode"] == "real" and r["agents"] == 1:
            out.append({"goal": "cold prefill of a 250K-class document >= 8K tok/s" + knobs(r),
                        "value": f"{r['prefill']['tok_s']:.0f} tok/s", "met": r["prefill"]["tok_s"] >= 8000})
        out.append({"goal": f"follow-up TTFT <= 1 s ({r['agents']} x {C.fmt_len(r['context'])}, agent 0 alone)"
                            + knobs(r),
                    "value": f"{r['followup']['ttft_s']:.2f} s", "met": r["followup"]["ttft_s"] <= 1.0})
    return out + DP.goals(list(dp_rows), LONG)


# ----------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------
def engine_knobs(command: str) -> tuple:
    """The engine flags (sparse and speculative knobs) of a point's command: two rows of the same point
    measured with different knobs are different rows of a merged report."""
    knobs = SPARSE_KNOBS + SPEC_KNOBS
    flags = {"--" + k.replace("_", "-") for k in knobs}
    switches = {f"--{no}{n.replace('_', '-')}" for n, _, f in flat_fields() if n in knobs and "bool" in str(f.type)
                for no in ("", "no-")}   # boolean knobs take no value (--x / --no-x)
    argv = shlex.split(command)
    return tuple((a, "" if "=" in a or a in switches else b) for a, b in zip(argv, argv[1:] + [""])
                 if a.split("=")[0] in flags | switches)


def merge(paths: list[str], out_dir: str, name: str) -> dict:
    import json
    from sketchkv.errors import SketchKVError
    parts = []
    for p in paths:
        if not os.path.isfile(p):
            raise SketchKVError(f"{p}: no such file")
        with open(p) as f:
            parts.append(json.load(f))
    merged = dict(parts[0])
    merged.pop("partial", None)
    rows = {}  # a point measured twice with the same engine knobs: the later file's row (and its file)
    for part in parts:
        for row in part["rows"]:
            key = (row["config"], row["agents"], row["context"], engine_knobs(row.get("command", "")))
            rows.pop(key, None)
            rows[key] = (row, part)
    sparse = {key: row.get("command", "") for key, (row, _) in rows.items() if row["config"] == "sparse"}
    knobs = dict(zip(sparse, distinct_knobs(list(sparse.values()))))   # what tells the sparse rows apart
    rows = {key: {**row, "label": label(row["config"], row_host_rows(part, row), row_head_combine(part, row),
                                        knobs.get(key, ()))}
            for key, (row, part) in rows.items()}
    merged["rows"] = list(rows.values())
    dp = {}  # data-parallel points likewise, keyed by their replica count too
    for part in parts:
        for row in part.get("dp_rows", []):
            key = (row["config"], row["agents_per_replica"], row["context"], row["data_parallel"])
            dp.pop(key, None)
            dp[key] = row
    merged["dp_rows"] = list(dp.values())
    DP.add_ratios(merged["dp_rows"], merged["rows"])
    fmt = lambda part, c: c.get("host_format", part["sparse"]["host_format"])  # noqa: E731  (older files lack it)
    merged["capacity"] = list({(c["config"], c["context"], fmt(part, c)): {**c, "host_format": fmt(part, c)}
                               for part in parts for c in part.get("capacity", [])}.values())  # the later file's
    merged["sources"] = [{"file": p, "command": part["info"]["command"], "date": part["info"]["date"],
                          "device": part["info"]["device"], "bandwidth": part.get("bandwidth")}
                         for p, part in zip(paths, parts)]
    merged["goals"] = goals(merged["rows"], merged["dp_rows"])
    C.write_outputs(merged, out_dir, name, markdown, plot)
    C.log(f"merged {len(paths)} files into {os.path.join(out_dir, name)}.md")
    return merged


def _gb(x) -> str:
    return "–" if x is None else f"{x / 1e9:.3g}"


def commands(r: dict) -> list[str]:
    seen = []
    for row in r["rows"] + r.get("dp_rows", []):
        if row["command"] not in seen:
            seen.append(row["command"])
    return seen


def _breakdown_table(rows, cols, title: str, note: str, sum_label: str, ref: dict) -> list[str]:
    """Markdown lines: one row per point, ms per step in each column, their sum and the graph step time
    (plus kernels per step when the profiler counted them)."""
    counted = "kernels_per_step" in rows[0]["breakdown"]
    head = "| config | agents x context | " + " | ".join(cols) + f" | {sum_label} | graph step |"
    head += " kernels/step | cmd |" if counted else " cmd |"
    out = ["", f"## {title}", "", f"{rows[0]['breakdown']['method']}: {note}", "", head,
           "|" + "---|" * (len(cols) + 5 + counted)]
    for row in rows:
        bd = row["breakdown"]
        out.append(f"| {row['label']} | {row['agents']} x {C.fmt_len(row['context'])} | "
                   + " | ".join(f"{bd['ms'].get(k, 0.0):.2f}" for k in cols)
                   + f" | {bd['total_ms']:.2f} | {bd['graph_step_ms']:.2f} |"
                   + (f" {bd['kernels_per_step']:.0f} |" if counted else "") + f" [{ref[row['command']]}] |")
    return out


def _streams_table(rows, ref: dict) -> list[str]:
    """Markdown lines: where the graph step's time goes by CUDA stream (breakdown.stream_times)."""
    if not rows:
        return []
    out = ["", "Streams: the step's own (main) stream runs the layers in order; side streams (the tier's admits and "
           "host writes) overlap it. Main stream waiting = graph step - its busy time: gaps between dependent kernels "
           "and the join on the side streams at the step's end.", "",
           "| config | agents x context | graph step ms | main stream busy ms (kernels) | side streams busy ms | "
           "GPU busy ms (any stream) | main stream waiting ms | cmd |", "|" + "---|" * 8]
    for row in rows:
        bd = row["breakdown"]
        main, side = bd["stream_ms"][0], sum(bd["stream_ms"][1:])
        ks = bd["stream_kernels"]
        out.append(f"| {row['label']} | {row['agents']} x {C.fmt_len(row['context'])} | {bd['graph_step_ms']:.2f} | "
                   f"{main:.2f} ({ks[0]:.0f}) | {side:.2f} ({sum(ks[1:]):.0f}) | {bd['gpu_busy_ms']:.2f} | "
                   f"{bd['graph_step_ms'] - main:.2f} | [{ref[row['command']]}] |")
    return out


def markdown(r: dict, png: str) -> str:
    info, bw, shp = r["info"], r["bandwidth"], r["shape"]
    cmds = commands(r)
    ref = {c: i + 1 for i, c in enumerate(cmds)}
    L = [f"# Agents benchmark: {os.path.basename(r['model'].rstrip('/'))}", "",
         f"- command: `{info['command']}`" if "sources" not in r else
         "- merged from: " + "; ".join(f"`{s['file']}` (`{s['command']}`, {s['date']})" for s in r["sources"]),
         f"- date {info['date']}; device {info['device']}; torch {info['torch']}",
         f"- measured in the run: HBM copy {bw['hbm'] / 1e9:.1f} GB/s (read + write)" +
         (f", pinned host-to-device {bw['pcie'] / 1e9:.1f} GB/s" if bw.get("pcie") else
          " (CPU: the host tier is main memory, its reads are counted at this bandwidth)"),
         f"- model shape: {shp['attn_layers']} full-attention layers x {shp['kv_heads']} KV heads x {shp['head_dim']}; "
         f"weights read per step {shp['weights'] / 1e9:.3g} GB; GDN state {shp['gdn_state'] / 1e6:.3g} MB per agent; "
         f"sketch rank {shp['rank']}",
         f"- sparse: top-k {r['sparse']['top_k']} + {r['sparse']['sink_tokens']} sinks + "
         f"{r['sparse']['recent_tokens']} recent, host rows {host_rows(r['sparse']['host_format'], r['sparse'].get('residual_keys', False))}, hot buffer "
         f"{r['sparse']['hot_fraction']:.3g} of each agent's tokens; prompts: {r['text']}", ""]
    L += ["## Decode, all agents at once", "",
          "Floor = bytes a step must move (weights + GDN state read/write + K/V rows read + sketch) / HBM bandwidth "
          "+ PCIe misses / PCIe bandwidth (`sketchkv/bench/floor.py`). Fraction = floor / measured step time.", "",
          "| config | agents x context | tok/s combined | per agent | ms/step | floor ms | floor fraction | "
          "HBM GB/step (weights / GDN / K/V rows / sketch) | PCIe MB/step | hit rate | GPU GB/agent | host GB/agent | "
          "prefill tok/s | follow-up TTFT s | cmd |",
          "|" + "---|" * 15]
    for row in r["rows"]:
        tag = f"{row['agents']} x {C.fmt_len(row['context'])}"
        if row["status"] != "ok":
            L.append(f"| {row['label']} | {tag} | {row['status']}: {row['reason']} |" + " |" * 11 + f" [{ref[row['command']]}] |")
            continue
        d, f, b, m, t = row["decode"], row["floor"], row["bytes_per_step"], row["memory"], row["tier"]
        fu, pf = row["followup"], row["prefill"]
        ttft = f"{fu['ttft_s']:.3f}" + (f" (others {fu['ttft_concurrent_max_s']:.3f} max)"
                                        if fu.get("ttft_concurrent_max_s") is not None else "")
        L.append(f"| {row['label']} | {tag} | {d['tok_s']:.1f} | {d['per_agent_tok_s']:.1f} | {d['step_ms_mean']:.2f} | "
                 f"{f['ms']:.2f} | {f['fraction']:.0%} | {b['hbm'] / 1e9:.3g} ({_gb(b['weights'])} / {_gb(b['gdn_state'])}"
                 f" / {_gb(b['kv'])} / {_gb(b['sketch'])}) | {b['pcie'] / 1e6:.3g} | "
                 f"{'–' if t is None else format(t['hit_rate'], '.3f')} | "
                 f"{_gb(m.get('gpu_bytes_per_agent', m.get('gpu_bytes_per_agent_arith')))} | "
                 f"{_gb(m.get('host_bytes_per_agent'))} | {pf['tok_s']:.0f}"
                 f"{'' if pf['mode'] == 'real' else ' (tail)'} | {ttft} | [{ref[row['command']]}] |")
    specs = [row for row in r["rows"] if row.get("status") == "ok" and row["decode"].get("speculative")]
    if specs:
        L += ["", "## Speculative decoding (MTP)", "",
              "Measured: tokens kept per step and tok/s of this model. On random weights the drafts are rejected, so "
              "each step drafts n tokens, verifies n + 1 rows and keeps one: the step time is a real verification "
              "step's. Projected = agents x the mean accepted length measured on a trained model (given with "
              "--reference-accepted-length) / that step time.", "",
              "| config | agents x context | drafts n | ms/step | accepted length (measured) | tok/s (measured) | "
              "reference accepted length | projected tok/s | verification graphs |", "|" + "---|" * 9]
        for row in specs:
            d, sp_ = row["decode"], row["decode"]["speculative"]
            fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
            L.append(f"| {row['label']} | {row['agents']} x {C.fmt_len(row['context'])} | {sp_['num_speculative_tokens']} | "
                     f"{d['step_ms_mean']:.2f} | {fmt(sp_['mean_accepted_length'], '.2f')} | {d['tok_s']:.1f} | "
                     f"{fmt(sp_['reference_accepted_length'], '.2f')} | {fmt(sp_['projected_tok_s'], '.1f')} | "
                     f"{'yes' if sp_['verification_graphs'] else 'no'} |")
    bds = [row for row in r["rows"] if row.get("status") == "ok" and row.get("breakdown")]
    kbds = [row for row in bds if "kernels" in row["breakdown"]]   # GPU: profiler over graph steps
    bds = [row for row in bds if "kernels" not in row["breakdown"]]  # CPU: eager region timers
    if kbds:
        kinds = list(dict.fromkeys(k for row in kbds for k in row["breakdown"]["ms"]))
        L += _breakdown_table(kbds, kinds, "Step time by kernel kind (CUDA-graph steps; ms per step)",
                              "GPU time of every kernel a step runs, summed by kind (`sketchkv/bench/breakdown.py`, "
                              "KERNEL_KINDS). The kernel sum counts the side streams' overlapped kernels too; the "
                              "streams table below splits the graph step (without it: kernel sum < graph step = gaps "
                              "between kernels).", "kernel sum", ref)
        L += _streams_table([row for row in kbds if "stream_ms" in row["breakdown"]], ref)
        big = kbds[-1]
        L += ["", f"Top kernels of {big['label']}, {big['agents']} x {C.fmt_len(big['context'])} (per step; all in the JSON):", "",
              "| kernel | kind | calls | us |", "|---|---|---|---|"]
        L += [f"| `{k['name'][:80]}` | {k['kind']} | {k['calls']:.0f} | {k['us']:.0f} |" for k in big["breakdown"]["kernels"][:30]]
    if bds:
        from sketchkv.bench.breakdown import GROUPS
        L += _breakdown_table(bds, GROUPS, "Step time by layer group (eager steps; ms per step)",
                              "Achieved GB/s = the group's bytes (weights, GDN state, sketch, K/V rows, PCIe "
                              "misses) / its time.", "eager sum", ref)
        L += ["", "| config | agents x context | weights GB/s | GDN GB/s | selection (sketch) GB/s | "
                  "attention + gather (rows) GB/s | PCIe misses GB/s |", "|---|---|---|---|---|---|---|"]
        for row in bds:
            bd, ms = row["breakdown"], row["breakdown"]["ms"]
            rate = lambda by, t: "–" if not by or t <= 0 else f"{by / (t / 1e3) / 1e9:.3g}"  # noqa: E731
            L.append(f"| {row['label']} | {row['agents']} x {C.fmt_len(row['context'])} | "
                     f"{rate(bd['bytes']['weights'], ms['weights'] + ms['lm_head'])} | {rate(bd['bytes']['gdn'], ms['gdn'])} | "
                     f"{rate(bd['bytes']['selection'], ms['selection'])} | "
                     f"{rate(bd['bytes']['attention'], ms['attention'] + ms['tier_gather'])} | "
                     f"{rate(bd['bytes']['pcie_misses'], ms['pcie_misses'])} |")
    L += DP.markdown(r, ref)
    L += ["", "## Where each configuration stops (memory arithmetic, before allocating)", "",
          "Per agent at the context plus this run's turn-1 and follow-up tokens; budgets: GPU memory x utilisation "
          "- weights - a prefill chunk's activations - 2 GiB (on a CPU: the dense KV budget); host: the tier's "
          "budget. transformers adds its one-forward prefill activations per agent.", "",
          "| config | context | GPU GB/agent | host GB/agent | max agents |", "|---|---|---|---|---|"]
    for c in r.get("capacity", []):
        L.append(f"| {label(c['config'], c['host_format'])} | {C.fmt_len(c['context'])} | "
                 f"{c['per_agent_gpu'] / 1e9:.3g} | "
                 f"{c['per_agent_host'] / 1e9:.3g} | {c['max_agents']} |")
    if r.get("goals"):
        L += ["", "## Goals (issue 8)", "", "| goal | value | met |", "|---|---|---|"]
        for g in r["goals"]:
            L.append(f"| {g['goal']} | {g['value']} | {'–' if g['met'] is None else ('yes' if g['met'] else 'no')} |")
    L += ["", f"![tok/s vs agents and vs context]({png})", "",
          "## Commands", "", "Each row's `[n]` is reproduced by:", ""]
    L += [f"{i + 1}. `{c}`" for i, c in enumerate(cmds)]
    L += ["", "Notes: decode steps are CUDA-graph replays with every agent in the batch; `tok/s combined` = agents / "
              "mean step time, `per agent` = 1 / mean step time (agents advance in lockstep). With `--fill random` the "
              "prefill column is the tail prefill (the last --tail tokens per agent over a cached prefix), not a cold "
              "prefill. Follow-up TTFT: agent 0's next turn alone (its whole conversation + the new tokens re-sent; the "
              "prefix cache serves it up to the last GDN snapshot), then the other agents' at once (max shown); an "
              "untimed warm-up turn (agent 0's conversation with another message) runs first, so first-use kernel "
              "compilation is not counted.", ""]
    return "\n".join(L)


def plot(r: dict, path: str) -> None:
    plt = C.pyplot()
    ok = [row for row in r["rows"] if row.get("status") == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def color(key):
        return colors.setdefault(key, palette[len(colors) % len(palette)])

    for ax, (xkey, gkey, xlabel) in zip(axes, (("agents", "context", "agents"), ("context", "agents", "context (tokens)"))):
        groups = {}
        for row in ok:   # one series per row label: a point measured with other engine knobs is a series of its own
            groups.setdefault((row.get("label", row["config"]).removeprefix("sketchkv "), row[gkey]), []).append(row)
        for (cfg, g), rows in sorted(groups.items()):
            rows = sorted(rows, key=lambda x: x[xkey])
            xs = [x[xkey] for x in rows]
            lab = f"{cfg} @ {C.fmt_len(g) if gkey == 'context' else str(g) + ' agents'}"
            c = color((cfg, g))
            ax.plot(xs, [x["decode"]["tok_s"] for x in rows], "o-", color=c, label=lab)
            # x markers: a series of one point shows its floor too
            ax.plot(xs, [x["floor"]["tok_s"] for x in rows], "x--", color=c, alpha=0.6, label=f"{lab}: floor")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("combined decode tok/s")
        ax.set_yscale("log")
        if ok and len({row[xkey] for row in ok}) > 1:
            ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("tok/s vs agents (x, dashed: bytes-moved floor)")
    axes[1].set_title("tok/s vs context (x, dashed: bytes-moved floor)")
    runs = [src["command"] for src in r["sources"]] if r.get("sources") else [r["info"]["command"]]
    text = "reproduce: " + "  |  ".join(f"[{chr(97 + i)}] {c}" for i, c in enumerate(runs))
    import textwrap
    lines = textwrap.wrap(text, 190)[:8]
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=6.5, va="bottom", family="monospace")
    fig.suptitle(f"{os.path.basename(r['model'].rstrip('/'))} on {r['info']['device']} ({r['info']['date'][:10]})")
    fig.tight_layout(rect=(0, 0.02 + 0.022 * len(lines), 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
