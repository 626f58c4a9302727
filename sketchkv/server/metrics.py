"""Prometheus metrics of the OpenAI server (one registry per app, so tests can run several apps).

Engine-side numbers (tokens, queue lengths, KV blocks, prefix cache) are sampled on the engine thread
after every step (`update_from_engine`); per-request numbers (TTFT, latency, finish reasons) are
recorded by the HTTP handlers (`observe_request`). prometheus-client's metrics are thread-safe.
With sparse miss_estimate the engine's per-step missed-mass estimates become `sketchkv_sparse_missed_mass`
(registered on the first update from such an engine, absent otherwise).

With data-parallel replicas (server/replica.py) each replica process keeps its own engine-side metrics
and sends them to the frontend (`engine_families`); the frontend's /metrics shows them once per family
with a `replica="i"` label (`ReplicaCollector`), next to its own per-request metrics.
"""
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

_MASS_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None, rate_window_s: float = 10.0, engine: bool = True):
        """engine=False: only the per-request metrics (a data-parallel frontend, whose engines live in
        replica processes and come in through `ReplicaCollector`)."""
        r = self.registry = registry or CollectorRegistry()
        p = "sketchkv_"
        self.requests = Counter(p + "requests", "finished requests by finish reason "
                                "(stop, length, abort = client went away, error)", ["finish_reason"], registry=r)
        self.requests_received = Counter(p + "requests_received", "requests handed to the engine", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "request arrival to first generated token",
                              buckets=_TIME_BUCKETS, registry=r)
        self.latency = Histogram(p + "e2e_request_latency_seconds", "request arrival to last token",
                                 buckets=_TIME_BUCKETS, registry=r)
        if engine:
            self._add_engine_metrics(r, p, rate_window_s)

    def _add_engine_metrics(self, r: CollectorRegistry, p: str, rate_window_s: float) -> None:
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens prefilled (counted at first token)",
                                     registry=r)
        self.steps = Counter(p + "engine_steps", "engine steps run", registry=r)
        self.generation_tps = Gauge(p + "generation_tokens_per_second",
                                    f"generated tokens per second over the last {rate_window_s:g} s", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "requests waiting for (more) prefill", registry=r)
        self.running = Gauge(p + "num_requests_running", "sequences decoding", registry=r)
        self.kv_blocks_used = Gauge(p + "kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge(p + "kv_blocks_total", "usable KV cache blocks", registry=r)
        self.prefix_cache_hit_rate = Gauge(p + "prefix_cache_hit_rate",
                                           "prompt tokens served from the prefix cache / prompt tokens looked up",
                                           registry=r)
        self.spec_accepted_length = Gauge(p + "spec_mean_accepted_length",
                                          "speculative decoding: tokens per verification step (accepted drafts + 1)",
                                          registry=r)
        # host KV tier (sparse_host_tier): zero until the engine has one
        self.tier_hits = Counter(p + "tier_hits", "host tier: picked rows found in the GPU hot buffer", registry=r)
        self.tier_misses = Counter(p + "tier_misses", "host tier: picked rows read from host memory", registry=r)
        self.tier_pcie_read_bytes = Counter(p + "tier_pcie_read_bytes", "host tier: bytes read from host memory "
                                            "(misses, prefix read-back)", registry=r)
        self.tier_pcie_write_bytes = Counter(p + "tier_pcie_write_bytes", "host tier: K/V bytes written to host memory",
                                             registry=r)
        self.tier_hit_rate = Gauge(p + "tier_hit_rate", "host tier: hits / (hits + misses) since start", registry=r)
        self.tier_host_bytes = Gauge(p + "tier_host_bytes", "host tier: host bytes allocated", registry=r)
        self.tier_gpu_bytes = Gauge(p + "tier_gpu_bytes", "host tier: GPU bytes allocated (sketches, sinks + recent "
                                    "rows, hot buffer)", registry=r)
        self.tier_host_bytes_used = Gauge(p + "tier_host_bytes_used", "host tier: host bytes of live sequences' "
                                          "blocks", registry=r)
        self.tier_gpu_bytes_used = Gauge(p + "tier_gpu_bytes_used", "host tier: GPU bytes held by live sequences",
                                         registry=r)
        self.engine_alive = Gauge(p + "engine_alive", "1 while the engine thread runs", registry=r)
        self.missed_mass = None   # sparse miss_estimate: registered once an engine with the estimate reports
        self._last = {"generation_tokens": 0, "prompt_tokens": 0, "steps": 0}
        self._tier_last = {"hits": 0, "misses": 0, "pcie_read_bytes": 0, "pcie_write_bytes": 0}
        self._window = rate_window_s
        self._samples: deque[tuple[float, int]] = deque()

    # ---- engine thread -------------------------------------------------------------------------
    def update_from_engine(self, engine) -> None:
        """Called on the engine thread (the only thread that may touch the engine)."""
        stats = engine.stats
        for key, counter in (("generation_tokens", self.generation_tokens), ("prompt_tokens", self.prompt_tokens),
                             ("steps", self.steps)):
            v = int(stats.get(key, 0))
            if v > self._last[key]:
                counter.inc(v - self._last[key])
            self._last[key] = v
        now = time.monotonic()
        self._samples.append((now, self._last["generation_tokens"]))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        self.generation_tps.set((self._last["generation_tokens"] - n0) / (now - t0) if now > t0 else 0.0)
        self.waiting.set(len(engine.scheduler.waiting))
        self.running.set(len(engine.scheduler.running))
        blocks = engine.blocks
        total = blocks.num_blocks - 1          # block 0 is the reserved scratch block
        self.kv_blocks_total.set(total)
        self.kv_blocks_used.set(total - blocks.num_free)
        queries = stats.get("prefix_cache_queries", 0)
        self.prefix_cache_hit_rate.set(stats.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        self.spec_accepted_length.set(stats.get("spec_mean_accepted_length", 0.0))
        tier = engine.tier_stats()  # one small device->host copy per step
        if tier is not None:
            for key, counter in (("hits", self.tier_hits), ("misses", self.tier_misses),
                                 ("pcie_read_bytes", self.tier_pcie_read_bytes),
                                 ("pcie_write_bytes", self.tier_pcie_write_bytes)):
                v = getattr(tier, key)
                if v > self._tier_last[key]:
                    counter.inc(v - self._tier_last[key])
                self._tier_last[key] = v
            self.tier_hit_rate.set(tier.hit_rate)
            self.tier_host_bytes.set(tier.host_bytes)
            self.tier_gpu_bytes.set(tier.gpu_bytes)
            per_seq = engine.tier_sequence_stats().values()
            self.tier_host_bytes_used.set(sum(s.host_bytes for s in per_seq))
            self.tier_gpu_bytes_used.set(sum(s.gpu_bytes for s in per_seq))

        if engine.miss_layers:
            self._update_missed_mass(engine)

    def _update_missed_mass(self, engine) -> None:
        if self.missed_mass is None:
            self.missed_mass = Histogram(
                "sketchkv_sparse_missed_mass", "sparse decode (sparse_miss_estimate): per sequence and decode step, "
                "the share of the candidates' estimated attention mass the top-k picks left out, mean over the "
                "selecting layers", buckets=_MASS_BUCKETS, registry=self.registry)
            self.missed_mass_last = Gauge("sketchkv_sparse_missed_mass_last", "mean sparse_missed_mass of the "
                                          "sequences in the last engine step that recorded one", registry=self.registry)
        est = engine.miss_estimates
        if est:
            step = []
            while est:
                step.append(est.popleft())
                self.missed_mass.observe(step[-1])
            self.missed_mass_last.set(sum(step) / len(step))

    # ---- handlers ------------------------------------------------------------------------------
    def observe_request(self, finish_reason: str, ttft: float | None, latency: float) -> None:
        self.requests.labels(finish_reason=finish_reason or "unknown").inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        self.latency.observe(latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- data-parallel replicas ----------------------------------------------------------------
    def engine_families(self) -> list[tuple]:
        """This registry's engine-side metrics as plain tuples (picklable): [(name, help, type,
        [(sample name, labels, value)])]; what a replica process sends to the frontend."""
        own = {"sketchkv_requests", "sketchkv_requests_received", "sketchkv_time_to_first_token_seconds",
               "sketchkv_e2e_request_latency_seconds", "sketchkv_engine_alive"}
        return [(m.name, m.documentation, m.type, [(s.name, dict(s.labels), s.value) for s in m.samples])
                for m in self.registry.collect() if m.name not in own]


class ReplicaCollector:
    """The replicas' engine metrics on the frontend's registry, each sample labelled with its replica;
    `sketchkv_engine_alive{replica}` comes from the frontend's own view (a crashed replica sends nothing)."""

    def __init__(self, replicas):
        self.replicas = replicas   # objects with .index, .alive and .metric_families (engine_families())

    def collect(self):
        alive = GaugeMetricFamily("sketchkv_engine_alive", "1 while the replica's engine runs", labels=["replica"])
        merged: dict[str, Metric] = {}
        for rep in self.replicas:
            alive.add_metric([str(rep.index)], 1.0 if rep.alive else 0.0)
            for name, doc, typ, samples in rep.metric_families:
                m = merged.setdefault(name, Metric(name, doc, typ))
                for sname, labels, value in samples:
                    m.add_sample(sname, {**labels, "replica": str(rep.index)}, value)
        yield alive
        yield from merged.values()
