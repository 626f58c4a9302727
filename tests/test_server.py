"""OpenAI-compatible server: a real `sketchkv serve` process on a tiny random checkpoint, driven with the
official `openai` client (and httpx for raw / malformed requests)."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from conftest import free_port, stop_process, wait_healthy

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

API_KEY = "sk-test-key"
MAX_LEN = 2048                 # small context, so "prompt beyond the context" is cheap to send
MAX_BODY = 1 << 20             # --max-request-bytes for the 413 test
NAME = "tiny-qwen"
WORDS = ("def f(x): return x + 1 import torch class A: pass hello world, the quick brown fox "
         "jumps over lazy dog").split()


def _prompt(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words))


class Server:
    def __init__(self, url: str, path: str, proc: subprocess.Popen, log_path: str):
        self.url, self.path, self.proc, self.log_path = url, path, proc, log_path
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        self.headers = {"Authorization": f"Bearer {API_KEY}"}
        from sketchkv.models.tokenizer import Tokenizer
        self.tok = Tokenizer(path)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(sketchkv_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def post(self, path: str, body, headers=None, timeout=60) -> httpx.Response:
        headers = self.headers if headers is None else headers
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        return httpx.post(self.url + path, content=body,
                          headers={"Content-Type": "application/json", **headers}, timeout=timeout)

    def ok(self) -> None:
        """A normal request still works."""
        r = self.client.completions.create(model=NAME, prompt="hello", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import make_checkpoint
    path = str(tmp_path_factory.mktemp("server") / NAME)
    make_checkpoint(path, "qwen3_5_text")
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("server-log") / "server.log")
    # The key through the environment. One intra-op thread: on a small shared CPU box an OpenMP team
    # competing with the server's event loop and the test's client threads stalls at every barrier.
    env = {**os.environ, "SKETCHKV_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "sketchkv", "serve", checkpoint, "--port", str(port), "--device", "cpu",
           "--max-model-len", str(MAX_LEN), "--max-request-bytes", str(MAX_BODY)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    srv = Server(url, checkpoint, proc, log_path)
    try:
        wait_healthy(url, proc, 180, srv.log)
        yield srv
    finally:
        stop_process(proc, 15)


# ---- basics --------------------------------------------------------------------------------------
def test_health_and_models(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in server.client.models.list().data] == [NAME]
    assert server.client.models.retrieve(NAME).id == NAME


def test_completion_usage_logprobs_and_stream(server):
    prompt = "import torch\nclass A:"
    kw = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    r = server.client.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(server.tok.encode(prompt))
    assert r.usage.completion_tokens == len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in c.logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - lp) < 1e-4 for t, lp in zip(c.logprobs.top_logprobs, c.logprobs.token_logprobs))
    assert c.logprobs.text_offset[0] == len(prompt)

    chunks = list(server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    toks = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert toks == c.logprobs.tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_seeded_sampling_repeats(server):
    kw = dict(model=NAME, prompt="hello world", max_tokens=8, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True})
    a, b = (server.client.completions.create(**kw, seed=7).choices[0].text for _ in range(2))
    assert a == b


def test_chat_usage_logprobs_and_stream(server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"}]
    kw = dict(model=NAME, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    r = server.client.chat.completions.create(**kw, max_completion_tokens=6, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(server.tok.encode(server.tok.apply_chat_template(messages), add_special_tokens=False))
    assert r.usage.completion_tokens == len(c.logprobs.content) == 6
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in c.logprobs.content)

    stream = server.client.chat.completions.create(**kw, max_tokens=6, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def _stop_string(text: str) -> str | None:
    for n in (3, 2, 1):
        for i in range(1, len(text) - n + 1):
            s = text[i:i + n]
            if "\ufffd" not in s and s.strip():
                return s
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, stream):
    prompt = _prompt(12, 3)
    base = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_string(base)
    if stop is None:
        pytest.skip(f"the random model's output has no usable stop string: {base!r}")
    expected = base[:base.find(stop)]
    for stops in (stop, ["never-in-output", stop]):
        kw = dict(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=stops, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(server.client.completions.create(**kw, stream=True))
            text = "".join(ch.choices[0].text for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            c = server.client.completions.create(**kw).choices[0]
            text, reason = c.text, c.finish_reason
        assert (text, reason) == (expected, "stop"), (base, stops)


# ---- concurrency ---------------------------------------------------------------------------------
def _run(server, kind: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """Greedy request; returns text, finish reason, usage and the chosen ids with their top-2 logprobs."""
    kw = dict(model=NAME, max_tokens=max_tokens, temperature=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    if kind == "chat":
        kw.update(messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=2)
        call = server.client.chat.completions.create
    else:
        kw.update(prompt=prompt, logprobs=2)
        call = server.client.completions.create
    parts, steps, reason, usage = [], [], None, None

    def take(c):
        if kind == "chat":
            parts.append((c.message.content if not stream else c.delta.content) or "")
            if c.logprobs:
                steps.extend((e.token, {t.token: t.logprob for t in e.top_logprobs}) for e in c.logprobs.content)
        else:
            parts.append(c.text)
            if c.logprobs:
                steps.extend(zip(c.logprobs.tokens, c.logprobs.top_logprobs))

    if stream:
        for ch in call(**kw, stream=True, stream_options={"include_usage": True}):
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
            if ch.choices:
                take(ch.choices[0])
                reason = ch.choices[0].finish_reason or reason
    else:
        r = call(**kw)
        take(r.choices[0])
        reason, usage = r.choices[0].finish_reason, r.usage.completion_tokens
    return {"text": "".join(parts), "reason": reason, "usage": usage, "steps": steps}


def _same_greedy_run(a: dict, b: dict) -> str | None:
    """None if two greedy runs of one request agree. Batched and solo runs differ in float rounding
    (~1e-6), so the chosen tokens may part only where the two best tokens were a near-tie."""
    if (a["reason"], a["usage"], len(a["steps"])) != (b["reason"], b["usage"], len(b["steps"])):
        return f"finish/usage differ: {a['reason'], a['usage'], len(a['steps'])} vs {b['reason'], b['usage']}"
    for k, ((ta, topa), (tb, topb)) in enumerate(zip(a["steps"], b["steps"])):
        if ta != tb:
            gap = abs(topa.get(ta, -1e9) - topa.get(tb, -1e9))
            return None if gap < 1e-4 else f"token {k}: {ta} vs {tb} (logprob gap {gap:.2e}, not a tie)"
    return None if a["text"] == b["text"] else f"text differs: {a['text']!r} vs {b['text']!r}"


def test_concurrent_streams_match_solo_runs(server):
    n = 16
    jobs = [("chat" if i % 3 == 0 else "text", _prompt(3 + (i * 37) % 220, i), 4 + (i * 5) % 21) for i in range(n)]
    before = server.metrics()
    results: list = [None] * n
    errors: list = []
    barrier = threading.Barrier(n)

    def worker(i):
        try:
            barrier.wait()
            results[i] = _run(server, *jobs[i], stream=True)
        except Exception as e:  # noqa: BLE001
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    after = server.metrics()
    tokens = after["sketchkv_generation_tokens_total"] - before["sketchkv_generation_tokens_total"]
    steps = after["sketchkv_engine_steps_total"] - before["sketchkv_engine_steps_total"]
    assert tokens == sum(j[2] for j in jobs)
    assert tokens >= 3 * steps, f"requests did not batch: {tokens} tokens in {steps} steps"
    for i, (kind, prompt, max_tokens) in enumerate(jobs):
        r = results[i]
        assert (r["reason"], r["usage"], len(r["steps"])) == ("length", max_tokens, max_tokens), (i, r)
        solo = _run(server, kind, prompt, max_tokens, stream=False)
        assert _same_greedy_run(r, solo) is None, (i, _same_greedy_run(r, solo))


# ---- faults --------------------------------------------------------------------------------------
def _wait_idle(server, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["sketchkv_num_requests_running"] == 0 and m["sketchkv_num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine still busy: {m}"
        time.sleep(0.1)


def test_client_disconnect_aborts_request(server):
    aborted = 'sketchkv_requests_total{finish_reason="abort"}'
    n0 = server.metrics().get(aborted, 0)
    # streaming: read a few chunks, then hang up
    # (2000 tokens take seconds on CPU; an abort takes milliseconds)
    stream = server.client.completions.create(model=NAME, prompt="hello", max_tokens=2000, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    m = _wait_idle(server)
    assert m.get(aborted, 0) == n0 + 1
    # non-streaming: the client times out and closes the connection
    with pytest.raises(httpx.TimeoutException):
        server.post("/v1/completions", {"model": NAME, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True},
                    timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 15
    while server.metrics().get(aborted, 0) < n0 + 2:
        assert time.monotonic() < deadline, "non-streaming request not aborted after the client left"
        time.sleep(0.1)
    m = _wait_idle(server)
    assert m["sketchkv_kv_blocks_total"] > 0
    server.ok()


def _check_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
BAD_REQUESTS = [
    ("malformed-json", TEXT, b'{"model": "tiny-qwen", "prompt": ', 400, None, "invalid_json"),
    ("not-an-object", TEXT, b'[1, 2]', 400, None, None),
    ("max_tokens-str", TEXT, {"model": NAME, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", None),
    ("temperature-str", CHAT, {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                               "temperature": "hot"}, 400, "temperature", None),
    ("messages-str", CHAT, {"model": NAME, "messages": "hi"}, 400, "messages", None),
    ("prompt-missing", TEXT, {"model": NAME}, 400, "prompt", None),
    ("max_tokens-0", TEXT, {"model": NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens-neg", CHAT, {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": -3}, 400, "max_tokens", None),
    ("n-2", TEXT, {"model": NAME, "prompt": "hi", "n": 2}, 400, "n", None),
    ("presence_penalty", CHAT, {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                "presence_penalty": 0.5}, 400, "presence_penalty", None),
    ("too-long-ids", TEXT, {"model": NAME, "prompt": list(range(3, 3 + MAX_LEN + 10))}, 400, "prompt",
     "context_length_exceeded"),
    ("too-long-chat", CHAT, {"model": NAME, "messages": [{"role": "user", "content": "hello world " * MAX_LEN}]},
     400, "messages", "context_length_exceeded"),
    ("unknown-model", CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model",
     "model_not_found"),
    ("too-large", TEXT, {"model": NAME, "prompt": "x" * (MAX_BODY + 10)}, 413, None, None),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, case):
    _, path, body, status, param, code = case
    _check_error(server.post(path, body), status, param, code)
    server.ok()


def test_auth_and_unknown_routes(server):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 1}
    _check_error(server.post(TEXT, body, headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    _check_error(server.post(TEXT, body, headers={}), 401)
    _check_error(httpx.get(server.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi", max_tokens=1)
    _check_error(httpx.get(server.url + "/v1/nowhere", headers=server.headers), 404)
    assert httpx.get(server.url + "/health").status_code == 200      # no key needed
    assert httpx.get(server.url + "/metrics").status_code == 200
    server.ok()


def test_followup_turn_reports_cached_tokens(server):
    system = "You are a careful assistant. " + _prompt(120, 5)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello world"}]
    r1 = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "the quick brown fox"}]
    r2 = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= 64
    assert r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens


def test_finished_request_log_line(server):
    server.ok()
    time.sleep(0.2)
    assert re.search(r"cmpl-\w+ \w+: prompt \d+ tokens \(\d+ cached\), generated \d+, TTFT [\d.]+ s, total [\d.]+ s, "
                     r"[\d.]+ tok/s", server.log())
    assert "POST /v1/completions" not in server.log()   # uvicorn access log off by default


# ---- engine death (in-process app) ---------------------------------------------------------------
def test_dead_engine_thread_gives_503(checkpoint):
    from starlette.testclient import TestClient

    from sketchkv.config import build_config
    from sketchkv.server.app import create_app
    app = create_app(build_config(model=checkpoint, device="cpu", max_model_len=MAX_LEN), api_key="")
    with TestClient(app) as client:
        body = {"model": NAME, "prompt": "hello", "max_tokens": 2}
        assert client.post(TEXT, json=body).status_code == 200
        engine = app.state.server.engine.engine

        def boom():
            raise RuntimeError("simulated device failure")
        engine.step = boom   # the test's own doing: the next step fails on the engine thread
        r = client.post(TEXT, json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        assert client.get("/health").status_code == 503
        r = client.post(CHAT, json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "simulated device failure" in r.json()["error"]["message"]
