"""The sparse missed-mass metric of a real `sketchkv serve` process on the bundled reference model, driven with
the official `openai` client: present with `--sparse-miss-estimate` (one observation per sequence and decode step,
in [0, 1]), absent without it."""
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import free_port, stop_process, wait_healthy

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

REF = os.path.join(os.path.dirname(__file__), "..", "sketchkv", "assets", "reference-model")
WORDS = "def f(x): return x + 1 import torch class A: pass hello world, the quick brown fox jumps".split()
MAX_TOKENS = 8


def value(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.skipif(not os.path.isfile(os.path.join(REF, "key_basis.safetensors")), reason="no bundled reference model")
@pytest.mark.parametrize("estimate", [True, False])
def test_sparse_missed_mass_metric_follows_the_option(estimate, tmp_path):
    port = free_port()
    log_path = str(tmp_path / "server.log")
    # a small budget (4 sinks + 16 picks + 8 recent of ~200 tokens), every decode step sparse
    cmd = [sys.executable, "-m", "sketchkv", "serve", REF, "--port", str(port), "--device", "cpu",
           "--max-model-len", "1024", "--sparse", "--sparse-top-k", "16", "--sparse-sink-tokens", "4",
           "--sparse-recent-tokens", "8", "--sparse-dense-threshold", "0"]
    cmd += ["--sparse-miss-estimate"] if estimate else []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180, lambda: open(log_path).read())
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompt = " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(150))
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
        # the engine thread updates the metrics after the step that finished the request: poll for it
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(url + "/metrics", timeout=10).text
            count = value(text, "sketchkv_sparse_missed_mass_count")
            if not estimate or count == MAX_TOKENS - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        stop_process(proc, 15)
    if not estimate:
        assert "sketchkv_sparse_missed_mass" not in text
        return
    assert count == MAX_TOKENS - 1      # one per decode step (the first token comes from the prefill)
    total = value(text, "sketchkv_sparse_missed_mass_sum")
    assert value(text, 'sketchkv_sparse_missed_mass_bucket{le="1.0"}') == count    # every value <= 1
    assert 0 < total / count < 1        # 16 of ~150 candidates picked: some mass missed, not all
    assert 0 < value(text, "sketchkv_sparse_missed_mass_last") <= 1
