"""Wall time per engine phase, for attribution (`bench_mtp.py --phases`).

Every phase is also a torch.profiler range. When timing is on, each phase starts and ends with a device
sync, so each holds its own host work and the device work it queued; a phase inside another counts only
in the inner one (times are exclusive), so the phases add up to the step. Python's garbage collections
count as their own phases, `python.gc0` / `gc1` / `gc2` by generation (a full collection walks every
token list of every sequence).
The syncs remove the overlap of host and device work: use the figures to see where a step goes, not
as its speed.
"""
import gc
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.profiler import record_function


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._inner: list[float] = []   # per open phase: seconds spent in phases nested inside it

    def reset(self, enabled: bool) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self.enabled = enabled
        self.seconds.clear()
        self.calls.clear()
        if enabled:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        took, name = time.perf_counter() - self._gc_start, f"python.gc{info['generation']}"
        self.seconds[name] += took
        self.calls[name] += 1
        if self._inner:
            self._inner[-1] += took

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, name: str):
        """A context manager for one phase: a bare profiler range unless timing is on (the decode hot path)."""
        return self._timed(name) if self.enabled else record_function(name)

    @contextmanager
    def _timed(self, name: str):
        with record_function(name):
            self._sync()
            t0 = time.perf_counter()
            self._inner.append(0.0)
            try:
                yield
                self._sync()
            finally:
                took = time.perf_counter() - t0
                inner = self._inner.pop()
                if self._inner:
                    self._inner[-1] += took
                self.seconds[name] += took - inner
                self.calls[name] += 1

    def report(self) -> dict:
        """{phase: {"ms": total, "calls": n, "ms_per_call": ...}}, longest first."""
        return {k: {"ms": 1e3 * s, "calls": self.calls[k], "ms_per_call": 1e3 * s / max(self.calls[k], 1)}
                for k, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
