"""The processes of a tensor-parallel engine (nano-vllm's pattern).

Rank 0 is the caller's process and runs the whole LLMEngine: scheduler, block manager, sampling.
Ranks 1..N-1 are spawned processes (torch.multiprocessing, "spawn") that hold only a ModelRunner
over their shard. Each runner call that runs the model (run, logits_for, save_state) is first
broadcast by rank 0 to the workers, method name and arguments pickled over a gloo group (the
batch as compact `StepSeq` copies), then every rank executes it, and the ranks meet in the
model's all-reduces (NCCL on cuda:0..N-1, gloo on CPU). Only rank 0 samples: workers drop their
logits, so sampling generators live on rank 0 alone. Everything a runner does at start (KV sizing,
warm-up, CUDA graph capture) runs the same on every rank, so collectives line up.

Spawn re-imports the caller's main module in each worker: a script that builds an engine with
tensor_parallel_size > 1 must do it under `if __name__ == "__main__":`.

Shutdown: `shutdown()` (also at interpreter exit) sends "exit" and joins the workers; a worker
whose parent process is gone exits by itself within a second.
"""
import atexit
import datetime
import logging
import os
import socket
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sketchkv.errors import SketchKVError

logger = logging.getLogger("sketchkv")
CALL_TIMEOUT = datetime.timedelta(days=365)  # workers wait for the next call as long as rank 0 idles


@dataclass
class StepSeq:
    """What a ModelRunner reads of a Sequence during one step, small to pickle (no history, no generator)."""
    num_cached: int
    new_token_ids: list[int]
    length: int
    block_table: list[int]
    state_slot: int
    restore_hash: int | None
    tier_pid: int = -1
    params: object = None
    generator: object = None
    draft_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, seq, n: int) -> "StepSeq":
        return cls(seq.num_cached, seq.step_token_ids(n), len(seq), list(seq.block_table), seq.state_slot,
                   seq.restore_hash, seq.tier_pid)

    def __len__(self) -> int:
        return self.length

    def step_token_ids(self, n: int) -> list[int]:
        return self.new_token_ids

    def block_table_tensor(self):
        """As Sequence.block_table_tensor (the table arrives as a fresh list every step)."""
        return torch.tensor(self.block_table, dtype=torch.int32)

    def num_drafts(self, n: int) -> int:
        return max(0, n - (self.length - self.num_cached))


def _compact(batch) -> list[tuple[StepSeq, int]]:
    return [(StepSeq.of(seq, n), n) for seq, n in batch]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU after the configured one (cuda -> cuda:r), or on the CPU."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def _join_group(rank: int, world: int, port: int, device: torch.device):
    """The model's group (NCCL or gloo, default group) and the call channel (gloo, no timeout)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    return dist.new_group(backend="gloo", timeout=CALL_TIMEOUT)


def _teardown(runner=None) -> None:
    """Drop this process's groups, after the runner's CUDA graphs: NCCL keeps a communicator alive while
    captured graphs hold work on it, so a destroy (or abort) with the graphs alive waits forever (both
    hung on the H200s, 2026-11-29, both ranks inside them). NCCL: abort, on every rank."""
    if runner is not None and runner.graphs:
        import gc
        runner.graphs.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.get_backend() == "nccl":
        abort()
    else:
        dist.destroy_process_group()


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch():
        while True:
            threading.Event().wait(1.0)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=watch, daemon=True, name="sketchkv-parent-watch").start()


def _worker(cfg, rank: int, port: int, device: torch.device, dtype: torch.dtype) -> None:
    from sketchkv.engine.model_runner import ModelRunner, load_capped_model
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    _exit_with_parent()
    world = cfg.tensor_parallel_size
    device = rank_device(device, rank)
    calls = _join_group(rank, world, port, device)
    if device.type == "cpu":  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(cfg.seed)
    model_cfg, model = load_capped_model(cfg, dtype, device)
    runner = ModelRunner(cfg, model_cfg, model, device, dtype)
    try:
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0, group=calls)
            method, args = msg[0]
            if method == "exit":
                break
            try:
                if isinstance(method, str):
                    getattr(runner, method)(*args)
                else:  # a module-level function, see TensorParallelRunner.on_every_rank
                    method(runner, *args)
            except SketchKVError:  # rank 0 meets the same one-line error and reports it
                pass
    finally:
        _teardown(runner)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelWorkers:
    """Rank 0's side: spawns ranks 1..N-1, joins the group, sends them the runner's calls."""

    def __init__(self, cfg, device: torch.device, dtype: torch.dtype):
        n = cfg.tensor_parallel_size
        if device.type == "cuda" and (device.index or 0) + n > torch.cuda.device_count():
            from sketchkv.errors import RequestError
            raise RequestError(f"tensor_parallel_size={n} needs {n} GPUs from cuda:{device.index or 0}; "
                               f"{torch.cuda.device_count()} visible")
        if dist.is_initialized():
            from sketchkv.errors import RequestError
            raise RequestError("a torch.distributed group is already running in this process (one "
                               "tensor-parallel engine per process; shut the other one down first)")
        self.runner = None  # rank 0's ModelRunner (driver()): its CUDA graphs go before the group does
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker, args=(cfg, r, port, device, dtype), daemon=True,
                                  name=f"sketchkv-tp{r}") for r in range(1, n)]
        for p in self.procs:
            p.start()
        self.closing = False
        threading.Thread(target=self._exit_if_a_worker_dies, daemon=True, name="sketchkv-tp-watch").start()
        self.device = rank_device(device, 0)
        try:
            self.calls = _join_group(0, n, port, self.device)
        except BaseException:
            self.kill()
            raise
        atexit.register(self.shutdown)

    def driver(self, runner) -> "TensorParallelRunner":
        self.runner = runner
        return TensorParallelRunner(runner, self)

    def _exit_if_a_worker_dies(self) -> None:
        """A rank that dies (an exception in its step, OOM, a kill) leaves rank 0 inside a collective that
        never completes (NCCL waits forever; run 13 on 2 x H200 hung this way when a worker's Triton
        compile failed). The engine cannot go on without the rank's shard: say which rank died and exit
        the process, like vLLM's executor does, instead of hanging."""
        from multiprocessing.connection import wait
        procs = list(self.procs)
        ready = wait([p.sentinel for p in procs])
        if self.closing:
            return
        for p in procs:
            if p.sentinel in ready:
                p.join(1.0)  # reaps it: exitcode
        dead = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in procs if p.sentinel in ready)
        msg = (f"tensor-parallel worker {dead} died (its traceback, if any, is above); "
               "rank 0 cannot continue without its shard: exiting")
        if logger.hasHandlers():
            logger.critical(msg)
            logging.shutdown()
        else:  # straight to fd 2: logging's last-resort handler lost it once in CI (rc 1, empty stderr)
            os.write(2, (msg + "\n").encode())
        os._exit(1)

    def call(self, method: str, *args) -> None:
        dist.broadcast_object_list([(method, args)], src=0, group=self.calls)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Workers leave their loop and exit; the group is torn down (after rank 0's CUDA graphs).
        Idempotent; also run at interpreter exit."""
        if not self.procs:
            return
        self.closing = True
        atexit.unregister(self.shutdown)
        told = False
        try:
            if all(p.is_alive() for p in self.procs):
                self.call("exit")
                told = True
        except RuntimeError:  # a worker died meanwhile (the gloo link is closed): nothing to tell
            pass
        if told:  # together with the workers, which tear theirs down on "exit"
            _teardown(self.runner)
        for p in self.procs:
            p.join(timeout)
        self.kill()

    def kill(self) -> None:
        """Without a goodbye (a failed start, a dead worker): terminate the workers, drop the group."""
        self.closing = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.procs = []
        _teardown()


class TensorParallelRunner:
    """Rank 0's ModelRunner: the calls that run the model reach every rank first; everything else
    (attributes, layers, caches) is rank 0's own runner."""

    def __init__(self, runner, workers: TensorParallelWorkers):
        self.runner, self.workers = runner, workers

    def __getattr__(self, name):
        return getattr(self.__dict__["runner"], name)

    def run(self, batch, sample_now: bool = True):
        self.workers.call("run", _compact(batch), False)  # workers never sample
        return self.runner.run(batch, sample_now)

    def logits_for(self, batch):
        self.workers.call("logits_for", _compact(batch))
        return self.runner.logits_for(batch)

    def save_state(self, block_hash: int, slot: int) -> None:
        self.workers.call("save_state", block_hash, slot)
        self.runner.save_state(block_hash, slot)

    def on_every_rank(self, fn, *args):
        """fn(runner, *args) on every rank at once (benchmarks: timing collectives); -> rank 0's result.
        fn must be importable by name (module level) and its arguments picklable."""
        self.workers.call(fn, *args)
        return fn(self.runner, *args)
