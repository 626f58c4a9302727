"""`sketchkv` command line. Errors in user input print one line and exit 2, without a traceback."""
import argparse
import sys

from sketchkv.config import add_dataclass_args, default_model
from sketchkv.errors import SketchKVError


def _generate(args) -> None:
    from sketchkv.config import build_config
    from sketchkv.engine.llm_engine import LLMEngine
    from sketchkv.sampling_params import SamplingParams
    engine = LLMEngine(build_config(args, model=args.model))
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
    import os
    from sketchkv.kv.fit_basis import default_calibration, fit_basis
    from sketchkv.llm import LLM
    llm = LLM(args.model, dtype=args.dtype or "auto", device=args.device or "auto",
              max_num_batched_tokens=args.seq_len)
    out = args.out or os.path.join(args.model, "key_basis.safetensors")
    basis = fit_basis(llm, args.calibration or [default_calibration()], args.rank, args.max_tokens, args.seq_len, out)
    ev = basis.meta["explained_variance"]
    mean_ev = sum(sum(r) for r in ev) / sum(len(r) for r in ev)
    print(f"wrote {out}: rank {basis.rank}, {basis.meta['tokens']} tokens, layers {basis.layers}, "
          f"mean explained variance {mean_ev:.3f}")


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
    app = create_app(build_config(args, model=args.model), args.served_model_name, args.api_key,
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


DEFAULT_PROMPT = "import torch\nfrom torch import nn\n\n\nclass"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sketchkv", description=__doc__.split(".")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (default model: the bundled reference model)")
    g.add_argument("--model", default=default_model(), help="Hugging Face model directory (default: bundled)")
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
    r = sub.add_parser("random-model", help="write a random-weight checkpoint of a named shape (a stand-in for "
                                            "smoke runs: its text is noise)")
    r.add_argument("preset", help="tiny-hybrid | qwen3.5-27b")
    r.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer)")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_random_model)
    f = sub.add_parser("fit-basis", help="fit the frozen key basis that sparse decode sketches keys with")
    f.add_argument("--model", default=default_model(), help="Hugging Face model directory (default: bundled)")
    f.add_argument("calibration", nargs="*", help="calibration files/dirs (default: the set shipped with the "
                                                   "reference model)")
    f.add_argument("--rank", type=int, default=None, help="basis rank (default: head_dim / 4)")
    f.add_argument("--max-tokens", type=int, default=262144, help="calibration tokens to use")
    f.add_argument("--seq-len", type=int, default=8192, help="tokens per calibration sequence")
    f.add_argument("--out", help="output file (default: MODEL/key_basis.safetensors)")
    f.add_argument("--dtype", default=None)
    f.add_argument("--device", default=None)
    f.set_defaults(func=_fit_basis)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("model", nargs="?", default=default_model(),
                   help="Hugging Face model directory (default: the bundled reference model)")
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
    e = sub.add_parser("eval", help="quality evaluation against dense: kld, recall, agents (JSON + Markdown + PNG)")
    esub = e.add_subparsers(dest="eval_command", required=True)
    from sketchkv.eval import COMMANDS, module
    helps = {"kld": "teacher-forced KL divergence and top-1 agreement against dense, with the dense noise floor",
             "recall": "lookup / copy needle recall from held-out code, dense vs each candidate, per length",
             "agents": "multi-turn recall over one long document: dense vs sparse vs prune-at-prefill"}
    for name in COMMANDS:
        ep = esub.add_parser(name, help=helps[name], description=module(name).__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module(name).add_args(ep)
        ep.set_defaults(func=_eval)
    b = sub.add_parser("bench", help="speed benchmarks against the bytes-moved floor (JSON + Markdown + PNG)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from sketchkv.bench import COMMANDS as BENCH, module as bench_module
    bhelps = {"agents": "N agents x L tokens decoding concurrently, then a follow-up turn: sparse + host tier vs "
                        "dense vs transformers"}
    for name in BENCH:
        bp = bsub.add_parser(name, help=bhelps[name], description=bench_module(name).__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
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
