"""Ctrl-C on a real `sketchkv serve` process: a clean log (no traceback) and exit code 130, idle or with
a streaming request in flight (which ends at once with a "shutting down" error event)."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("in_flight", [False, True])
def test_sigint_shuts_down_cleanly(in_flight):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # A background process of a non-interactive shell starts with SIGINT ignored: restore the default,
    # as a terminal's Ctrl-C finds it.
    proc = subprocess.Popen([sys.executable, "-m", "sketchkv", "serve", "--device", "cpu", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
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
