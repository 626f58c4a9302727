"""OpenAI-compatible HTTP server: FastAPI app factory.

    app = create_app(engine_config, served_model_name="my-model", api_key=None)

Requests are validated and tokenized on the asyncio side (with a tokenizer of the server's own: the
engine and its tokenizer belong to the engine thread), handed to the engine thread as token ids, and
answered from the per-request event queue it fills (see engine_thread.py). A client that goes away
(stream cancelled, or disconnect noticed while waiting) has its request aborted in the engine.

With `data_parallel` N > 1 the engines are N replica processes (replica.py) with the same interface, and
each request goes where router.py says (session key, prefix affinity, load); the response header
`X-Sketchkv-Replica` names the replica that served it.
"""
import asyncio
import hmac
import json
import logging
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sketchkv.config import EngineConfig
from sketchkv.errors import SketchKVError
from sketchkv.sampling_params import SamplingParams
from sketchkv.server import protocol as P
from sketchkv.server.engine_thread import EngineDeadError, EngineThread, Event
from sketchkv.server.metrics import ReplicaCollector, ServerMetrics
from sketchkv.server.protocol import ApiError

log = logging.getLogger("sketchkv.server")

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20   # agents send 250K-token conversations (~1 MB of text, more as JSON)
_OFFLOAD_CHARS = 32_768                  # tokenize / parse bigger inputs off the event loop
_DISCONNECT_CHECK_S = 0.25   # how often a waiting handler looks for a gone client / dead engine
_OFFLOAD_TOKENS = 32_768     # route (hash) longer prompts off the event loop


def default_served_name(model: str) -> str:
    if model.startswith("random:"):
        return model
    return os.path.basename(os.path.normpath(model)) or model


class ClientGone(Exception):
    """The HTTP client disconnected; its request has been aborted."""


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the alphabet byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _loc(loc: tuple) -> str:
    """'messages.0.content' from a pydantic error location, without union-member tags like 'list[str]'."""
    keep = [str(x) for x in loc if isinstance(x, int) or not (
        "[" in x or x in ("str", "int", "float", "bool", "none") or x[:1].isupper() or "-" in x)]
    return ".".join(keep) or "body"


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _map_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), code="engine_unavailable", type="server_error")
    if isinstance(e, SketchKVError):
        code = "context_length_exceeded" if "context limit" in str(e) else None
        return ApiError(400, str(e), code=code)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error", type="server_error")


class _Server:
    """Shared state of one app: engine thread, tokenizer, metrics, settings."""

    def __init__(self, cfg: EngineConfig, served_model_name: str, api_key: str | None, max_request_bytes: int,
                 data_parallel: int = 1):
        self.cfg = cfg
        self.name = served_model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.router = None
        if data_parallel > 1:
            from sketchkv.server.replica import ReplicaClient, plan_replicas
            from sketchkv.server.router import Router
            self.router = Router(data_parallel, cfg.cache.block_size)
            self.engines = [ReplicaClient(p, on_finished=self._finished) for p in plan_replicas(cfg, data_parallel)]
            self.metrics = ServerMetrics(engine=False)
            self.metrics.registry.register(ReplicaCollector(self.engines))
        else:
            self.metrics = ServerMetrics()
            self.engines = [EngineThread(cfg, self.metrics)]
        self.engine = self.engines[0]   # model facts (max_model_len, tokenizer) are the same on every replica
        self.tokenizer = None
        self.created = P.now()
        self._started = False
        self._shutdown_lock = threading.Lock()
        self._tok_cache: dict[int, tuple[str, bytes]] = {}
        self._byte_decoder: dict[str, int] | None = None

    def startup(self) -> None:
        """Build the engine (on its thread) and the server's tokenizer; raises if the model cannot load."""
        if self._started:
            return
        for e in self.engines:   # replicas build their engines in parallel
            e.start()
        try:
            for e in self.engines:
                e.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        if self.engine.has_tokenizer:
            from sketchkv.models.tokenizer import Tokenizer
            self.tokenizer = Tokenizer(self.cfg.model)
        self._started = True

    def shutdown(self) -> None:
        with self._shutdown_lock:  # `sketchkv serve` calls it on a signal while the lifespan may call it too
            for e in self.engines:
                e.shutdown()

    # ---- data-parallel routing -----------------------------------------------------------------
    async def pick_replica(self, ids: list[int], session: str | None) -> int:
        if self.router is None:
            return 0
        if len(ids) > _OFFLOAD_TOKENS:
            return await anyio.to_thread.run_sync(self._route, ids, session)
        return self._route(ids, session)

    def _route(self, ids: list[int], session: str | None) -> int:
        with self.router.lock:
            i, why = self.router.route(ids, session, [e.load() for e in self.engines])
        log.debug("request of %d tokens -> replica %d (%s)", len(ids), i, why)
        return i

    def _finished(self, replica: int, ids: list[int]) -> None:
        """A replica's reader thread: its prefix cache now also holds the request's output."""
        with self.router.lock:
            self.router.record(replica, ids)

    # ---- request plumbing ----------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def read_json(self, request: Request):
        limit = self.max_request_bytes
        too_big = ApiError(413, f"request body is over the server's limit of {limit} bytes "
                                f"(--max-request-bytes)", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            if len(body) > _OFFLOAD_CHARS:
                return await anyio.to_thread.run_sync(json.loads, body)
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from None

    def validate(self, cls, data):
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = cls.model_validate(data)
        except ValidationError as e:
            errs = e.errors()
            field = str(errs[0]["loc"][0]) if errs[0]["loc"] else None
            # a union field (e.g. stop: str | list[str]) reports one error per member: show them together
            msgs = [er["msg"] for er in errs if (str(er["loc"][0]) if er["loc"] else None) == field]
            where = _loc(errs[0]["loc"])
            raise ApiError(400, f"invalid '{where}': " + "; or ".join(dict.fromkeys(msgs)), field,
                           "invalid_value") from None
        if req.model != self.name:
            raise ApiError(404, f"The model `{req.model}` does not exist (this server serves `{self.name}`)",
                           "model", "model_not_found")
        P.unsupported(req)
        return req

    def sampling_params(self, req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise ApiError(400, "stop strings must not be empty", "stop")
        kw = dict(temperature=1.0 if req.temperature is None else req.temperature,
                  top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, max_tokens=max_tokens,
                  stop=stop, logprobs=logprobs)
        for name in ("top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output"):
            if getattr(req, name) is not None:
                kw[name] = getattr(req, name)
        try:
            return SamplingParams(**kw)
        except SketchKVError as e:
            raise ApiError(400, str(e)) from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: True for a raw prompt (the tokenizer's BOS, as vLLM), False for a rendered chat template."""
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        if len(text) > _OFFLOAD_CHARS:
            return await anyio.to_thread.run_sync(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    def check_length(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        limit = self.engine.max_model_len
        if limit is not None and len(ids) >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens (prompt + at least one "
                                f"generated token). However, your {param} resulted in {len(ids)} tokens.",
                           param, "context_length_exceeded")

    def token_str(self, tid: int) -> str:
        return self._token(tid)[0]

    def token_bytes(self, tid: int) -> bytes:
        """The token's own bytes (a byte-level BPE token may hold part of a UTF-8 character, which its
        decoded string shows only as U+FFFD)."""
        return self._token(tid)[1]

    def _tok(self, tid: int, as_ids: bool) -> tuple[str, bytes]:
        if as_ids:   # vLLM's return_tokens_as_token_ids: "token_id:123", unambiguous
            s = f"token_id:{tid}"
            return s, s.encode()
        return self._token(tid)

    def completion_logprobs(self, ids: list[int], lps: list[float], top, n_top: int, offset: int,
                            as_ids: bool) -> dict:
        strs = [self._tok(t, as_ids)[0] for t in ids]
        tops = [[(self._tok(t, as_ids)[0], v) for t, v in row] for row in top] if n_top and top else None
        return P.completion_logprobs(strs, lps, tops, offset)

    def chat_logprobs(self, ids: list[int], lps: list[float], top, n_top: int, as_ids: bool) -> dict:
        toks = [self._tok(t, as_ids) for t in ids]
        tops = [[(self._tok(t, as_ids), v) for t, v in row] for row in top] if n_top and top else None
        return P.chat_logprobs(toks, lps, tops)

    def _token(self, tid: int) -> tuple[str, bytes]:
        hit = self._tok_cache.get(tid)
        if hit is None:
            if self.tokenizer is None:
                hit = (f"token_id:{tid}", f"token_id:{tid}".encode())
            else:
                text = self.tokenizer.decode([tid], skip_special_tokens=False)
                raw = self._byte_level_bytes(tid)
                hit = (text, raw if raw is not None else text.encode("utf-8"))
            if len(self._tok_cache) < 1_000_000:
                self._tok_cache[tid] = hit
        return hit

    def _byte_level_bytes(self, tid: int) -> bytes | None:
        if self._byte_decoder is None:
            try:
                dec = json.loads(self.tokenizer.tok.to_str()).get("decoder") or {}
            except Exception:  # noqa: BLE001
                dec = {}
            self._byte_decoder = _gpt2_byte_decoder() if dec.get("type") == "ByteLevel" else {}
        piece = self.tokenizer.tok.id_to_token(tid) if self._byte_decoder else None
        if piece is None or any(c not in self._byte_decoder for c in piece):
            return None
        return bytes(self._byte_decoder[c] for c in piece)


class _Handle:
    """One request in the engine, seen from its HTTP handler."""

    def __init__(self, server: _Server, request: Request, rid: str, t0: float):
        self.s, self.request, self.rid, self.t0 = server, request, rid, t0
        self.replica = 0
        self.engine = server.engine
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.num_prompt = self.num_cached = self.num_generated = 0
        self.first_token: float | None = None
        self.done = False
        self._checked = time.monotonic()

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Sketchkv-Replica": str(self.replica)}

    async def start(self, ids: list[int], params: SamplingParams, session: str | None = None) -> None:
        self.replica = await self.s.pick_replica(ids, session)
        self.engine = self.s.engines[self.replica]
        try:
            self.engine.submit(self.rid, ids, params, asyncio.get_running_loop(), self.queue)
        except EngineDeadError as e:
            raise _map_error(e) from None
        ev = await self.next()
        if ev.kind == "error":
            self.done = True
            raise _map_error(ev.error)
        self.num_prompt = ev.num_prompt_tokens
        self.s.metrics.requests_received.inc()

    async def next(self) -> Event:
        while True:
            now = time.monotonic()
            if now - self._checked > _DISCONNECT_CHECK_S:
                self._checked = now
                if await self.request.is_disconnected():
                    self.abort()
                    raise ClientGone()
            if not self.queue.empty():
                ev = self.queue.get_nowait()
            else:
                try:
                    ev = await asyncio.wait_for(self.queue.get(), _DISCONNECT_CHECK_S)
                except TimeoutError:
                    if not self.engine.alive:
                        self.done = True
                        raise _map_error(EngineDeadError(self.engine._dead_message())) from None
                    continue
            if ev.kind == "output":
                if self.first_token is None and ev.token_ids:
                    self.first_token = ev.time
                self.num_generated += len(ev.token_ids)
                self.num_cached = ev.num_cached_tokens
                if ev.finished:
                    self._finish(ev.finish_reason or "stop", ev.time)
            elif ev.kind == "error" and self.num_prompt:
                self._finish("error", time.monotonic())
            return ev

    def abort(self) -> None:
        """Client gone (or handler cancelled): free the sequence in the engine."""
        if not self.done:
            self.engine.abort(self.rid)
            self._finish("abort", time.monotonic())

    def _finish(self, reason: str, t_end: float) -> None:
        if self.done:
            return
        self.done = True
        total = t_end - self.t0
        ttft = None if self.first_token is None else self.first_token - self.t0
        self.s.metrics.observe_request(reason, ttft, total)
        log.info("%s %s: prompt %d tokens (%d cached), generated %d, TTFT %s, total %.3f s, %.1f tok/s",
                 self.rid, reason, self.num_prompt, self.num_cached, self.num_generated,
                 "-" if ttft is None else f"{ttft:.3f} s", total, self.num_generated / total if total > 0 else 0.0)


def create_app(engine_config: EngineConfig, served_model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, data_parallel: int = 1) -> FastAPI:
    """The app; its engine starts with the app's lifespan (or earlier: `app.state.server.startup()`).

    api_key None: taken from $SKETCHKV_API_KEY if set; empty: no authentication. data_parallel N > 1: N
    replica processes (one per GPU) behind this app."""
    if api_key is None:
        api_key = os.environ.get("SKETCHKV_API_KEY") or None
    server = _Server(engine_config, served_model_name or default_served_name(engine_config.model), api_key,
                     max_request_bytes, data_parallel)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await anyio.to_thread.run_sync(server.startup)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(server.shutdown)

    app = FastAPI(title="sketchkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    # ---- errors in OpenAI's shape --------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, e: ClientGone):
        return Response(status_code=499)   # nobody is listening; nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(P.error_body(str(e.detail), "invalid_request_error" if e.status_code < 500
                                         else "server_error"), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(P.error_body(str(e.errors())), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(_map_error(e).body(), status_code=500)

    # ---- endpoints -----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if server.router is not None:   # data-parallel: 200 while any replica serves ("degraded" if not all)
            reps = [{"replica": e.index, "alive": e.alive, "device": e.device, "pid": e.pid,
                     "in_flight": e.load().in_flight, **({} if e.alive else {"error": e._dead_message()})}
                    for e in server.engines]
            up = sum(r["alive"] for r in reps)
            status = "ok" if up == len(reps) else "degraded" if up else "unavailable"
            return JSONResponse({"status": status, "replicas": reps}, status_code=200 if up else 503)
        if server.engine.alive:
            return {"status": "ok"}
        return JSONResponse(_map_error(EngineDeadError(server.engine._dead_message())).body(), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def list_models(request: Request):
        server.check_auth(request)
        return P.models_response(server.name, server.engine.max_model_len, server.created)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        server.check_auth(request)
        if model_id != server.name:
            raise ApiError(404, f"The model `{model_id}` does not exist", "model", "model_not_found")
        return P.model_card(server.name, server.engine.max_model_len, server.created)

    @app.post("/v1/completions")
    async def completions(request: Request, response: Response):
        t0 = time.monotonic()
        server.check_auth(request)
        req: P.CompletionRequest = server.validate(P.CompletionRequest, await server.read_json(request))
        params = server.sampling_params(req, req.max_tokens, req.logprobs)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, prompt_text = await server.encode(prompt), prompt
        else:
            ids = list(prompt)
            prompt_text = ""
            if server.tokenizer is not None and req.logprobs is not None:   # for text_offset only
                prompt_text = server.tokenizer.decode(ids, skip_special_tokens=False)
        server.check_length(ids, "prompt")
        h = _Handle(server, request, f"cmpl-{uuid.uuid4().hex}", t0)
        await h.start(ids, params, request.headers.get("x-session-id") or req.user)
        response.headers.update(h.headers)
        created = P.now()
        want_lp = req.logprobs is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _stream(server, h, params, include_usage, created, chat=False, want_lp=want_lp,
                           text_offset=len(prompt_text), as_ids=bool(req.return_tokens_as_token_ids))
        ev, tokens, lps, tops = await _collect(h)
        logprobs = None
        if want_lp:
            logprobs = server.completion_logprobs(tokens, lps, tops, req.logprobs or 0, len(prompt_text),
                                                  bool(req.return_tokens_as_token_ids))
        return P.completion_response(h.rid, server.name, created, ev.text, ev.finish_reason, logprobs,
                                     P.usage(h.num_prompt, len(tokens), h.num_cached))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, response: Response):
        t0 = time.monotonic()
        server.check_auth(request)
        req: P.ChatCompletionRequest = server.validate(P.ChatCompletionRequest, await server.read_json(request))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        n_top = req.top_logprobs or 0
        params = server.sampling_params(req, max_tokens, n_top if req.logprobs else None)
        if server.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
        messages = P.message_dicts(req.messages)
        try:
            if sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)) > _OFFLOAD_CHARS:
                text = await anyio.to_thread.run_sync(server.tokenizer.apply_chat_template, messages)
            else:
                text = server.tokenizer.apply_chat_template(messages)
        except SketchKVError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # jinja errors from a template that does not accept these messages
            raise ApiError(400, f"chat template: {type(e).__name__}: {e}", "messages") from None
        ids = await server.encode(text, add_special_tokens=False)
        server.check_length(ids, "messages")
        h = _Handle(server, request, f"chatcmpl-{uuid.uuid4().hex}", t0)
        await h.start(ids, params, request.headers.get("x-session-id") or req.user)
        response.headers.update(h.headers)
        created = P.now()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _stream(server, h, params, include_usage, created, chat=True, want_lp=bool(req.logprobs),
                           n_top=n_top, as_ids=bool(req.return_tokens_as_token_ids))
        ev, tokens, lps, tops = await _collect(h)
        logprobs = None
        if req.logprobs:
            logprobs = server.chat_logprobs(tokens, lps, tops, n_top, bool(req.return_tokens_as_token_ids))
        return P.chat_response(h.rid, server.name, created, ev.text, ev.finish_reason, logprobs,
                               P.usage(h.num_prompt, len(tokens), h.num_cached))

    return app


async def _collect(h: _Handle):
    """Wait for a non-streamed request to finish; aborts it if the client goes away."""
    tokens: list[int] = []
    lps: list[float] = []
    tops: list = []
    try:
        while True:
            ev = await h.next()
            if ev.kind == "error":
                raise _map_error(ev.error)
            tokens += ev.token_ids
            if ev.logprobs is not None:
                lps += ev.logprobs
                tops += ev.top_logprobs or [[] for _ in ev.token_ids]
            if ev.finished:
                return ev, tokens, lps, tops
    finally:
        h.abort()   # no-op once finished; frees the sequence if the handler was cancelled


def _safe_end(text: str, sent: int, finished: bool, holdback: int) -> int:
    """How far the text may be streamed: not a trailing partial UTF-8 character (decoded as U+FFFD,
    which the next token may complete) nor the last `holdback` characters, which may start a stop
    string (the engine cuts the stop string off the final text)."""
    if finished:
        return len(text)
    end = len(text)
    while end > sent and text[end - 1] == "\ufffd":
        end -= 1
    return max(sent, min(end, len(text) - holdback))


def _stream(server: _Server, h: _Handle, params: SamplingParams, include_usage: bool, created: int, chat: bool,
            want_lp: bool, n_top: int = 0, text_offset: int = 0, as_ids: bool = False) -> StreamingResponse:
    holdback = max((len(s) for s in params.stop), default=1) - 1
    name = server.name
    top_n = n_top if chat else (params.logprobs or 0)

    async def gen():
        sent, offset, n_tokens = 0, text_offset, 0
        try:
            if chat:
                yield _sse(P.chat_chunk(h.rid, name, created, {"role": "assistant", "content": ""}, None, None,
                                        include_usage))
            while True:
                try:
                    ev = await h.next()
                except ApiError as e:
                    yield _sse(e.body())
                    return
                if ev.kind == "error":
                    yield _sse(_map_error(ev.error).body())
                    return
                n_tokens += len(ev.token_ids)
                end = _safe_end(ev.text, sent, ev.finished, holdback)
                delta = ev.text[sent:end] if end > sent else ""
                sent = max(sent, end)
                lp = None
                if want_lp and ev.logprobs is not None:
                    if chat:
                        lp = server.chat_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs, top_n, as_ids)
                    else:
                        lp = server.completion_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs, top_n, offset,
                                                        as_ids)
                        offset += sum(len(s) for s in lp["tokens"])
                reason = ev.finish_reason if ev.finished else None
                if delta or lp or ev.finished:
                    if chat:
                        yield _sse(P.chat_chunk(h.rid, name, created, {"content": delta} if delta or not reason
                                                else {}, reason, lp, include_usage))
                    else:
                        yield _sse(P.completion_chunk(h.rid, name, created, delta, reason, lp, include_usage))
                if ev.finished:
                    if include_usage:
                        yield _sse(P.usage_chunk(h.rid, name, created,
                                                 "chat.completion.chunk" if chat else "text_completion",
                                                 P.usage(h.num_prompt, n_tokens, h.num_cached)))
                    yield "data: [DONE]\n\n"
                    return
        except ClientGone:
            return
        finally:
            h.abort()   # no-op when finished; otherwise the client went away (or we were cancelled)

    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **h.headers})
