"""Ctrl-C on a real `sketchkv serve` process: a clean log (no traceback) and exit code 130, idle or with
a streaming request in flight (which ends at once with a "shutting down" error event)."""
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import free_port, wait_healthy


@pytest.mark.parametrize("in_flight", [False, True])
def test_sigint_shuts_down_cleanly(in_flight):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A background process of a non-interactive shell starts with SIGINT ignored: restore the default,
    # as a terminal's Ctrl-C finds it.
    proc = subprocess.Popen([sys.executable, "-m", "sketchkv", "serve", "--device", "cpu", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_healthy(url, proc, 120)
        deadline = time.monotonic() + 120
        lines = []
        if in_flight:
            def stream():
                body = {"model": "reference-model", "prompt": "def f(x):", "max_tokens": 100000, "stream": True,
                        "ignore_eos": True}
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    lines.extend(r.iter_lines())
            client = threading.Thread(target=stream, daemon=True)
            client.start()
            while not any('"text"' in line for line in lines):  # tokens are flowing
                assert client.is_alive() and time.monotonic() < deadline
                time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err, err
    assert proc.returncode == 130, err
    assert "stopped by signal 2: exit code 130" in err
    assert time.monotonic() - t0 < 4, "in-flight requests should not wait for the graceful timeout (5 s)"
    if in_flight:
        client.join(10)
        assert "shutting down" in "".join(lines) and lines[-1] != "data: [DONE]"
