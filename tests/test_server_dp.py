"""Data-parallel serving (`sketchkv serve --data-parallel 2` on a CPU): two real replica processes of the
bundled reference model behind one real HTTP server, driven with the official `openai` client. The replica
that served a response is in its `X-Sketchkv-Replica` header."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from sketchkv.config import EngineConfig                  # noqa: E402
from sketchkv.errors import SketchKVError                 # noqa: E402
from sketchkv.server.replica import gpus_for_replicas, plan_replicas   # noqa: E402
from conftest import free_port, stop_process, wait_healthy  # noqa: E402

NAME = "reference-model"
WORDS = ("def f(x): return x + 1 import torch class A: pass hello world, the quick brown fox "
         "jumps over lazy dog").split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i * i) % len(WORDS)] for i in range(n_words))


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()   # a zombie has exited (nobody may reap it in a container)
    except FileNotFoundError:
        return True


class DPServer:
    def __init__(self, url: str, proc: subprocess.Popen, log_path: str):
        self.url, self.proc, self.log_path = url, proc, log_path
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def chat(self, messages, max_tokens=4, **kw):
        """(content, replica index, usage)."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=NAME, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
        r = raw.parse()
        return r.choices[0].message.content, int(raw.headers["x-sketchkv-replica"]), r.usage


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("dp-log") / "server.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SKETCHKV_API_KEY", None)
    cmd = [sys.executable, "-m", "sketchkv", "serve", "--data-parallel", "2", "--port", str(port),
           "--device", "cpu", "--max-model-len", "2048", "--max-num-seqs", "4"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = DPServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_healthy(srv.url, proc, 240, srv.log)
        yield srv
    finally:
        stop_process(proc)


def test_two_replicas_answer(server):
    h = server.health()
    assert h["status"] == "ok" and [r["replica"] for r in h["replicas"]] == [0, 1]
    pids = [r["pid"] for r in h["replicas"]]
    assert all(r["alive"] for r in h["replicas"]) and len(set(pids)) == 2 and server.proc.pid not in pids
    content, replica, usage = server.chat([{"role": "user", "content": "hello"}])
    assert replica in (0, 1) and usage.completion_tokens >= 1 and isinstance(content, str)
    r = server.client.completions.create(model=NAME, prompt="import torch\n", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_conversation_turns_stay_on_their_replica_and_hit_its_prefix_cache(server):
    # With nothing in flight, load alone would send turn 2 to the *other* replica (the one remembering
    # fewer blocks): landing on turn 1's replica is the prefix affinity.
    for seed in (1, 2):
        turn1 = [{"role": "user", "content": text(260, seed)}]
        answer, r1, u1 = server.chat(turn1)
        assert u1.prompt_tokens >= 256
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": text(20, seed + 5)}]
        _, r2, u2 = server.chat(turn2)
        assert r2 == r1
        assert u2.prompt_tokens_details.cached_tokens >= 256, u2


def test_session_key_pins_unrelated_prompts_to_one_replica(server):
    _, a, _ = server.chat([{"role": "user", "content": "first " + text(8, 3)}], user="agent-42")
    _, b, _ = server.chat([{"role": "user", "content": "second " + text(8, 4)}], user="agent-42")
    _, c, _ = server.chat([{"role": "user", "content": text(8, 5)}], extra_headers={"X-Session-ID": "agent-42"})
    assert a == b == c


def test_concurrent_new_conversations_spread_over_both_replicas(server):
    kw = dict(model=NAME, temperature=0, extra_body={"ignore_eos": True})
    raw = server.client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": text(30, 7)}], max_tokens=400, stream=True, **kw)
    first = int(raw.headers["x-sketchkv-replica"])
    stream = raw.parse()
    next(iter(stream))   # conversation A is decoding: its replica has one request in flight
    _, second, _ = server.chat([{"role": "user", "content": text(30, 8)}])
    stream.close()
    assert {first, second} == {0, 1}


def test_metrics_are_labelled_by_replica(server):
    deadline = time.monotonic() + 15
    while True:
        m = httpx.get(server.url + "/metrics", timeout=10).text
        gen = {int(x): float(v) for x, v in re.findall(r'^sketchkv_generation_tokens_total\{replica="(\d)"\} (\S+)$',
                                                        m, re.M)}
        if len(gen) == 2 and all(v > 0 for v in gen.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(gen) == 2 and all(v > 0 for v in gen.values()), m
    assert 'sketchkv_engine_alive{replica="0"} 1.0' in m and 'sketchkv_engine_alive{replica="1"} 1.0' in m
    assert re.search(r"^sketchkv_requests_total\{finish_reason=\"length\"\} [1-9]", m, re.M)   # frontend's own


def test_plan_splits_host_budget_and_refuses_more_replicas_than_gpus():
    cfg = EngineConfig(device="cpu")
    cfg.sparse.sparse = cfg.sparse.host_tier = True
    plans = plan_replicas(cfg, 3)
    assert [p.index for p in plans] == [0, 1, 2] and {p.gpu for p in plans} == {None}
    assert len({p.cfg.sparse.host_budget_gb for p in plans}) == 1 and plans[0].cfg.sparse.host_budget_gb > 0
    assert [p.cfg.seed for p in plans] == [0, 1, 2] and cfg.sparse.host_budget_gb is None   # cfg untouched
    cfg.sparse.host_budget_gb = 5.0
    assert all(p.cfg.sparse.host_budget_gb == 5.0 for p in plan_replicas(cfg, 2))   # the flag is per replica
    import torch
    n = torch.cuda.device_count()
    with pytest.raises(SketchKVError, match=f"--data-parallel {n + 1} needs {n + 1} GPUs"):
        plan_replicas(EngineConfig(device="cuda"), n + 1)
    with pytest.raises(SketchKVError, match="not cuda:1"):
        plan_replicas(EngineConfig(device="cuda:1"), 2)
    with pytest.raises(SketchKVError, match="--data-parallel with --tensor-parallel"):
        plan_replicas(EngineConfig(device="cpu", tensor_parallel_size=2), 2)


def test_replicas_share_a_gpu_only_when_their_memory_caps_fit_it():
    assert gpus_for_replicas(2, ["0", "1", "2"], None, 80.0) == ["0", "1"]
    assert gpus_for_replicas(4, ["3", "5"], 24.0, 79.6) == ["3", "5", "3", "5"]     # two 24 GiB engines per card
    assert gpus_for_replicas(5, ["0"], 24.0, 139.8) == ["0"] * 5
    with pytest.raises(SketchKVError, match="3 x gpu_memory_gb=24.0 exceeds a 60.0 GiB card"):
        gpus_for_replicas(5, ["0", "1"], 24.0, 60.0)
    with pytest.raises(SketchKVError, match="needs 2 GPUs .* --gpu-memory-gb"):
        gpus_for_replicas(2, ["0"], None, 139.8)
    with pytest.raises(SketchKVError, match="needs 2 GPUs .*0 visible"):
        gpus_for_replicas(2, [], 24.0, 0.0)


def test_bad_model_is_a_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sketchkv", "serve", str(tmp_path / "missing"), "--data-parallel", "2",
                        "--device", "cpu"], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    # refused before any replica starts: the path is checked up front
    assert r.stderr.startswith("sketchkv: error: ") and "missing: no such file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # a directory that exists but is no checkpoint: the replica's own load error, one line, names the replica
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "sketchkv", "serve", str(tmp_path / "empty"), "--data-parallel", "2",
                        "--device", "cpu"], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert "sketchkv: error: replica 0 (cpu):" in r.stderr and "config.json" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_crashed_replica_fails_its_requests_and_shows_in_health(server):
    _, victim, _ = server.chat([{"role": "user", "content": "pin"}], user="victim")
    pid = server.health()["replicas"][victim]["pid"]
    result = {}

    def long_request():
        try:
            server.chat([{"role": "user", "content": "a long answer"}], max_tokens=1900, user="victim",
                        extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            result["status"] = e.status_code
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while server.health()["replicas"][victim]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert result.get("status") == 503
    h = server.health()
    assert h["status"] == "degraded" and not h["replicas"][victim]["alive"] and h["replicas"][1 - victim]["alive"]
    assert "exit code -9" in h["replicas"][victim]["error"]
    _, replica, _ = server.chat([{"role": "user", "content": "still there?"}], user="victim")   # re-routed
    assert replica == 1 - victim


def test_replicas_leave_with_a_killed_frontend(server):
    pids = [r["pid"] for r in server.health()["replicas"]]
    server.proc.kill()   # no shutdown handler runs: the replicas see their command pipe close
    server.proc.wait()
    deadline = time.monotonic() + 20
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(p) for p in pids)
