"""The thread that owns the LLMEngine.

The engine is not thread-safe, so exactly one thread (this one) calls into it: it builds it, adds and
aborts requests, and steps it while there is work. HTTP handlers (on the asyncio loop) talk to it
through `commands`, a thread-safe queue, and get results back on their own asyncio.Queue, filled with
`loop.call_soon_threadsafe` (one call per step and loop, carrying every request's event of that step).

Each request's queue receives, in order: one `accepted` event (or one `error` event if add_request
refused it), then one `output` event per step that gave it a token, the last with `finished=True`;
or an `error` event if the engine failed it. Output events carry only the tokens new since the
previous event (plus the full text so far), so no list the engine keeps mutating crosses threads.
"""
import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from sketchkv.config import EngineConfig
from sketchkv.errors import SketchKVError
from sketchkv.sampling_params import SamplingParams

log = logging.getLogger("sketchkv.server")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (it failed to start or crashed)."""


@dataclass
class Event:
    kind: str                                        # "accepted" | "output" | "error"
    token_ids: list[int] = field(default_factory=list)   # new since the previous event
    logprobs: list[float] | None = None                   # for token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None
    text: str = ""                                   # output text so far, whole characters; stop string cut at the end
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: BaseException | None = None
    time: float = field(default_factory=time.monotonic)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0              # output tokens already delivered


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)


class EngineThread:
    def __init__(self, cfg: EngineConfig, metrics=None, idle_poll_s: float = 0.1):
        self.cfg = cfg
        self.metrics = metrics
        self.idle_poll_s = idle_poll_s
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.engine = None                  # only the engine thread touches it
        self.max_model_len: int | None = None
        self.has_tokenizer = not cfg.model.startswith("random:")
        self._routes: dict[str, _Route] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sketchkv-engine", daemon=True)

    # ---- any thread ----------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        if not self.started:
            self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine is built; re-raise the error if building it failed."""
        if not self.ready.wait(timeout):
            raise TimeoutError("the engine did not start in time")
        if self.error is not None:
            raise self.error

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.error is None and self._thread.is_alive()

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> None:
        if not self.alive:
            raise EngineDeadError(self._dead_message())
        self.commands.put(_Add(request_id, prompt, params, loop, q))

    def abort(self, request_id: str) -> None:
        self.commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.commands.put(None)  # wake the loop
        if self.started:
            self._thread.join(timeout)

    def _dead_message(self) -> str:
        if not self.ready.is_set():
            return "the engine is still starting"
        return f"the engine is not running ({type(self.error).__name__}: {self.error})" if self.error \
            else "the engine is not running"

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        from sketchkv.engine.llm_engine import LLMEngine
        try:
            self.engine = LLMEngine(self.cfg)
            self.max_model_len = self.engine.cfg.scheduler.max_model_len
            self.has_tokenizer = self.engine.tokenizer is not None
        except BaseException as e:  # noqa: BLE001 - reported by wait_ready
            self.error = e
            self.ready.set()
            return
        if self.metrics is not None:
            self.metrics.engine_alive.set(1)
            self.metrics.update_from_engine(self.engine)
        self.ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001
            log.exception("engine thread died; failing every request in flight")
            self.error = e
        finally:
            if self.metrics is not None:
                self.metrics.engine_alive.set(0)
            self._fail_all(EngineDeadError(self._dead_message() if self.error else "the server is shutting down"))
            self.engine.shutdown()  # tensor-parallel worker processes

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain(block=not eng.has_unfinished)
            if self._stop.is_set():
                return
            if eng.has_unfinished:
                try:
                    outputs = eng.step()
                except SketchKVError as e:
                    # A waiting request that can never fit (e.g. more tokens than the whole KV cache):
                    # fail that one request and keep serving the rest.
                    if not eng.scheduler.waiting:
                        raise
                    rid = eng.scheduler.waiting[0].request_id
                    eng.abort(rid)
                    route = self._routes.pop(rid, None)
                    if route is not None:
                        self._post(route.loop, [(route.queue, Event("error", error=e))])
                    log.warning("request %s failed: %s", rid, e)
                    continue
                self._publish(outputs)
            if self.metrics is not None:
                self.metrics.update_from_engine(eng)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=self.idle_poll_s) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        eng = self.engine
        if isinstance(cmd, _Add):
            try:
                seq = eng.add_request(cmd.prompt, cmd.params, cmd.request_id)
            except Exception as e:  # noqa: BLE001 - RequestError/CapacityError -> 4xx; anything else -> 500
                self._post(cmd.loop, [(cmd.queue, Event("error", error=e))])
                return
            self._routes[cmd.request_id] = _Route(cmd.loop, cmd.queue)
            self._post(cmd.loop, [(cmd.queue, Event("accepted", num_prompt_tokens=seq.num_prompt_tokens))])
        elif isinstance(cmd, _Abort):
            if self._routes.pop(cmd.request_id, None) is not None:
                eng.abort(cmd.request_id)

    def _publish(self, outputs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            n = route.sent
            route.sent = len(out.token_ids)
            ev = Event("output", token_ids=list(out.token_ids[n:]),
                       logprobs=None if out.logprobs is None else list(out.logprobs[n:]),
                       top_logprobs=None if out.top_logprobs is None else list(out.top_logprobs[n:]),
                       text=out.text, finished=out.finished, finish_reason=out.finish_reason,
                       stop_reason=out.stop_reason, num_prompt_tokens=len(out.prompt_token_ids),
                       num_cached_tokens=out.num_cached_tokens)
            if out.finished:
                del self._routes[out.request_id]
            by_loop.setdefault(route.loop, []).append((route.queue, ev))
        for loop, items in by_loop.items():
            self._post(loop, items)

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Event]]) -> None:
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _fail_all(self, error: BaseException) -> None:
        routes, self._routes = self._routes, {}
        for route in routes.values():
            self._post(route.loop, [(route.queue, Event("error", error=error))])
        while True:  # requests handed over but never added
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._post(cmd.loop, [(cmd.queue, Event("error", error=error))])
