"""Data-parallel replicas: one engine per process (and per GPU) behind the one HTTP frontend.

Processes, not threads: each replica's Python work (scheduling, sampling, detokenizing) runs under its
own GIL, so one engine never slows another. Inside a replica process the engine runs exactly as in the
single-engine server, on an `EngineThread` (server/engine_thread.py). The frontend talks to it over two
pipes:

    frontend -- ("add", rid, ids, params) | ("abort", rid) | None (stop) -->  replica -> EngineThread
    frontend <-- ("ready", ...) | ("error", msg) | ("dead", msg) | ("events", [(rid, Event)]) | ("metrics", ...)

`ReplicaClient` is the frontend's handle, with EngineThread's interface (start, wait_ready, alive, submit,
abort, shutdown), so the HTTP handlers do not care which one they talk to. It also counts the load the
router needs (requests in flight, prompt tokens still waiting for prefill).

Failures: a replica that cannot build its engine sends a one-line error and exits (startup raises it).
A replica whose engine thread dies fails its requests (as EngineThread does), says why and exits; a
replica process that dies outright closes its pipe, and the frontend's reader thread fails every request
still routed there (503) and marks the replica dead (/health). Replicas are daemon processes and also
leave when their command pipe closes (the frontend died), so none outlive the server.
"""
import copy
import multiprocessing as mp
import os
import pickle
import threading
import time
from dataclasses import dataclass, field

from sketchkv.config import EngineConfig
from sketchkv.errors import SketchKVError
from sketchkv.server.engine_thread import EngineDeadError, EngineThread, Event
from sketchkv.server.router import Load

METRICS_EVERY_S = 1.0   # how often a replica sends its engine metrics to the frontend


@dataclass
class ReplicaPlan:
    index: int
    cfg: EngineConfig
    gpu: str | None        # CUDA_VISIBLE_DEVICES of the replica process (None: CPU)
    threads: int           # torch CPU threads (0: leave torch's default)


def plan_replicas(cfg: EngineConfig, n: int) -> list[ReplicaPlan]:
    """Replica i on GPU i (of the visible ones); on a CPU, n replicas sharing the cores. The host tier's
    default budget (half the available RAM) is split between the replicas: each holds its own tier."""
    import torch
    if n > 1 and cfg.tensor_parallel_size > 1:  # replicas are daemon processes: they cannot spawn TP ranks
        raise SketchKVError("--data-parallel with --tensor-parallel > 1 is not supported yet: run one "
                            "`sketchkv serve --tensor-parallel N` per group of GPUs instead")
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    gpus: list[str | None] = [None] * n
    if cuda:
        if ":" in cfg.device:
            raise SketchKVError(f"--data-parallel puts replica i on GPU i: give --device cuda (or auto), "
                                f"not {cfg.device}")
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        count = torch.cuda.device_count()
        ids = (visible or [str(i) for i in range(count)])[:count]
        card_gib = min((torch.cuda.get_device_properties(i).total_memory for i in range(count)), default=0) / 2**30
        gpus = gpus_for_replicas(n, ids, cfg.cache.gpu_memory_gb, card_gib)
    sp = cfg.sparse
    host_gb = sp.host_budget_gb
    if sp.host_tier and host_gb is None:
        from sketchkv.kv.host_tier import default_host_budget
        host_gb = default_host_budget() / n / 2**30
    plans = []
    for i in range(n):
        c = copy.deepcopy(cfg)
        c.device = "cuda" if cuda else cfg.device
        c.seed = cfg.seed + i            # unseeded sampling differs between replicas
        c.sparse.host_budget_gb = host_gb
        plans.append(ReplicaPlan(i, c, gpus[i], 0 if cuda else max(1, (os.cpu_count() or 1) // n)))
    return plans


def gpus_for_replicas(n: int, ids: list[str], cap_gb: float | None, card_gib: float) -> list[str]:
    """Replica i on GPU ids[i % len(ids)]: one engine per GPU, or, when each engine is capped to gpu_memory_gb
    and that many caps fit a card, several per GPU (their allocators each refuse past their cap)."""
    if n <= len(ids):
        return ids[:n]
    per_gpu = -(-n // max(1, len(ids)))
    if not ids or cap_gb is None or per_gpu * cap_gb > card_gib:
        share = f"; {per_gpu} x gpu_memory_gb={cap_gb} exceeds a {card_gib:.1f} GiB card" if ids and cap_gb else \
            " (or cap each engine with --gpu-memory-gb so that several fit one card)"
        raise SketchKVError(f"--data-parallel {n} needs {n} GPUs (one engine per GPU); {len(ids)} visible{share}")
    return [ids[i % len(ids)] for i in range(n)]


# ---- the replica process -------------------------------------------------------------------------
def _portable(ev: Event) -> Event:
    """An Event that survives pickling: an error the pipe cannot carry becomes a plain one, same kind."""
    if ev.error is not None:
        try:
            pickle.loads(pickle.dumps(ev.error))
        except Exception:  # noqa: BLE001 - any unpicklable exception
            cls = SketchKVError if isinstance(ev.error, SketchKVError) else RuntimeError
            ev.error = cls(f"{type(ev.error).__name__}: {ev.error}")
    return ev


class _Outbox:
    """Stands in for the asyncio loop that EngineThread posts events to: its `call_soon_threadsafe(_deliver,
    items)` becomes one pipe message (the request id stands in for the asyncio.Queue)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()    # the engine thread and the replica's main thread both send

    def send(self, msg) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):   # the frontend is gone; the main loop sees EOF and exits
                pass

    def call_soon_threadsafe(self, _deliver, items) -> None:
        self.send(("events", [(rid, _portable(ev)) for rid, ev in items]))


def replica_main(plan: ReplicaPlan, commands, events) -> None:
    if plan.gpu is not None:   # before torch starts CUDA: the replica sees its one GPU as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = plan.gpu
    import torch
    if plan.threads:   # a share of the cores, never more than OMP_NUM_THREADS asks for
        torch.set_num_threads(min(plan.threads, torch.get_num_threads()))
    from sketchkv.server.metrics import ServerMetrics
    out = _Outbox(events)
    metrics = ServerMetrics()
    engine = EngineThread(plan.cfg, metrics)
    engine.start()
    try:
        engine.wait_ready()
    except BaseException as e:  # noqa: BLE001 - reported to the frontend as one line
        out.send(("error", f"{type(e).__name__}: {e}"))
        return
    out.send(("ready", engine.max_model_len, engine.has_tokenizer, os.getpid()))
    last = 0.0
    try:
        while engine.alive:
            if commands.poll(METRICS_EVERY_S):
                cmd = commands.recv()          # EOFError: the frontend died
                if cmd is None:
                    break
                if cmd[0] == "add":
                    _, rid, ids, params = cmd
                    try:
                        engine.submit(rid, ids, params, out, rid)
                    except EngineDeadError as e:
                        out.call_soon_threadsafe(None, [(rid, Event("error", error=e))])
                else:
                    engine.abort(cmd[1])
            if time.monotonic() - last >= METRICS_EVERY_S:
                last = time.monotonic()
                out.send(("metrics", metrics.engine_families()))
    except (EOFError, OSError):
        pass
    if engine.error is not None:
        out.send(("dead", engine._dead_message()))
    engine.shutdown()


# ---- the frontend's handle -------------------------------------------------------------------------
@dataclass
class _Route:
    loop: object                # asyncio loop of the waiting handler
    queue: object               # its asyncio.Queue
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    prefilled: bool = False     # has produced a token: its prompt no longer waits


class ReplicaClient:
    def __init__(self, plan: ReplicaPlan, on_finished=None):
        self.plan = plan
        self.index = plan.index
        self.on_finished = on_finished   # called (replica index, prompt + output ids) when a request finishes
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.max_model_len: int | None = None
        self.has_tokenizer = not plan.cfg.model.startswith("random:")
        self.pid: int | None = None
        self.metric_families: list = []
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._proc = self._commands = self._events = self._reader = None

    @property
    def device(self) -> str:
        return f"cuda (GPU {self.plan.gpu})" if self.plan.gpu is not None else self.plan.cfg.device

    @property
    def started(self) -> bool:
        return self._proc is not None

    def start(self) -> None:
        if self.started:
            return
        ctx = mp.get_context("spawn")   # CUDA cannot be forked; a fresh interpreter per replica
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._events, ev_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=replica_main, args=(self.plan, cmd_recv, ev_send),
                                 name=f"sketchkv-replica-{self.index}", daemon=True)
        self._proc.start()
        cmd_recv.close()   # the child's ends: now each side sees EOF when the other goes
        ev_send.close()
        self._reader = threading.Thread(target=self._read, name=f"sketchkv-replica-{self.index}-reader",
                                        daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise TimeoutError(f"replica {self.index} did not start in time")
        if self.error is not None:
            raise self.error

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.error is None and self._proc is not None and self._proc.is_alive()

    def load(self) -> Load:
        with self._lock:
            queued = sum(len(r.prompt) for r in self._routes.values() if not r.prefilled)
            return Load(len(self._routes), queued, self.alive)

    def submit(self, request_id: str, prompt: list[int], params, loop, q) -> None:
        if not self.alive:
            raise EngineDeadError(self._dead_message())
        with self._lock:
            self._routes[request_id] = _Route(loop, q, list(prompt))
        try:
            self._send(("add", request_id, prompt, params))
        except (OSError, ValueError):
            with self._lock:
                self._routes.pop(request_id, None)
            raise EngineDeadError(self._dead_message()) from None

    def abort(self, request_id: str) -> None:
        with self._lock:
            gone = self._routes.pop(request_id, None)
        if gone is not None:
            try:
                self._send(("abort", request_id))
            except (OSError, ValueError):
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._proc is None:
            return
        try:
            self._send(None)
        except (OSError, ValueError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)

    def _dead_message(self) -> str:
        if not self.ready.is_set():
            return f"replica {self.index} is still starting"
        return str(self.error) if self.error is not None else f"replica {self.index} is not running"

    def _send(self, msg) -> None:
        with self._send_lock:
            self._commands.send(msg)

    # ---- reader thread ---------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._events.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "events":
                self._dispatch(msg[1])
            elif kind == "metrics":
                self.metric_families = msg[1]
            elif kind == "ready":
                _, self.max_model_len, self.has_tokenizer, self.pid = msg
                self.ready.set()
            elif kind == "error":   # the engine could not be built
                self.error = SketchKVError(f"replica {self.index} ({self.device}): {msg[1]}")
            elif kind == "dead":
                self.error = EngineDeadError(f"replica {self.index}: {msg[1]}")
        self._proc.join(5)
        if self.error is None:
            self.error = EngineDeadError("the server is shutting down" if self._stopping else
                                         f"replica {self.index} exited (exit code {self._proc.exitcode})")
        self.ready.set()
        with self._lock:
            routes, self._routes = self._routes, {}
        for route in routes.values():
            EngineThread._post(route.loop, [(route.queue, Event("error", error=self.error))])

    def _dispatch(self, items: list[tuple[str, Event]]) -> None:
        by_loop: dict[object, list] = {}
        finished = []
        with self._lock:
            for rid, ev in items:
                route = self._routes.get(rid)
                if route is None:   # aborted meanwhile
                    continue
                if ev.kind == "output":
                    route.prefilled = True
                    if self.on_finished is not None:
                        route.output += ev.token_ids
                if ev.kind == "error" or ev.finished:
                    del self._routes[rid]
                    if ev.kind == "output":
                        finished.append(route.prompt + route.output)
                by_loop.setdefault(route.loop, []).append((route.queue, ev))
        for loop, out in by_loop.items():
            EngineThread._post(loop, out)
        if self.on_finished is not None:
            for ids in finished:
                self.on_finished(self.index, ids)
