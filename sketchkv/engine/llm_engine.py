"""The engine loop: requests in, scheduled steps, tokens out.

Owns the live requests (`add_request` / `abort` / `step` -> `RequestOutput`s), wires the model (loaded here, or by
tensor-parallel workers), the scheduler, the model runner, the speculative drafter and the detokenizer together,
and answers for the whole engine: `teacher_force` (the quality evaluations), `tier_stats` (the host tier's
counters), `shutdown`."""
import gc
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from sketchkv.config import EngineConfig
from sketchkv.engine.detokenizer import IncrementalDetokenizer
from sketchkv.engine.model_runner import ModelRunner, load_capped_model
from sketchkv.engine.phase_timer import PhaseTimer
from sketchkv.engine.scheduler import Scheduler
from sketchkv.engine.sequence import Sequence
from sketchkv.errors import RequestError
from sketchkv.kv.block_manager import BlockManager
from sketchkv.layers.rejection_sampler import VerifyOutput
from sketchkv.layers.sampler import SampleOutput
from sketchkv.models.loader import load_model_config
from sketchkv.models.tokenizer import Tokenizer
from sketchkv.sampling_params import SamplingParams

logger = logging.getLogger("sketchkv")
LONG_PREFILL = 32768  # prompts at least this long log their prefill progress
# A new request's token lists (and everything else alive) move to Python's permanent GC generation, until a
# sequence finishes: every collection that meets a list walks all its elements. Young, 8 new 248K-token
# requests cost ~90 ms of collections before their first tokens (H200 run 66); old, a full collection takes
# ~36 ms at 24 lists of 254K tokens on a CPU core. Objects are still freed by reference counting; cyclic
# garbage made while frozen is collected after the next unfreeze.
FREEZE_GC = True

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    num_cached_tokens: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise RequestError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        sc = cfg.scheduler
        max_pos = load_model_config(cfg.model).max_position_embeddings
        sc.max_model_len = min(sc.max_model_len or max_pos, max_pos)
        self.workers = None
        if cfg.tensor_parallel_size > 1:  # ranks 1..N-1 start first and load their copy while we load ours
            from sketchkv.parallel.tensor_parallel import check_supported
            from sketchkv.parallel.workers import TensorParallelWorkers
            check_supported(cfg, load_model_config(cfg.model))
            self.workers = TensorParallelWorkers(cfg, self.device, self.dtype)
            self.device = self.workers.device
        try:
            torch.manual_seed(cfg.seed)
            self.model_config, self.model = load_capped_model(cfg, self.dtype, self.device)
            # Random-weight presets have no tokenizer: they take token ids only.
            self.tokenizer = None if cfg.model.startswith("random:") else Tokenizer(cfg.model)
            self.eos_token_ids = set(self.model_config.eos_token_ids) | self._generation_eos(cfg.model)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                self.eos_token_ids.add(self.tokenizer.eos_token_id)
            self.runner = ModelRunner(cfg, self.model_config, self.model, self.device, self.dtype)
        except BaseException:
            if self.workers is not None:  # they may be anywhere in their start: no goodbye message
                self.workers.kill()
            raise
        self.phase = PhaseTimer(self.device)   # named ranges; per-phase wall time when enabled (bench_mtp --phases)
        self.runner.phase = self.phase
        if self.workers is not None:
            self.runner = self.workers.driver(self.runner)
        self.blocks = BlockManager(self.runner.num_blocks, cfg.cache.block_size)
        cc = cfg.cache
        self.scheduler = Scheduler(sc, self.blocks, sc.max_num_seqs, prefix_caching=cc.enable_prefix_caching,
                                   states=self.runner.state_cache,
                                   snapshot_interval=cc.snapshot_interval_blocks * cc.block_size,
                                   num_speculative_tokens=cfg.num_speculative_tokens,
                                   tier=self.runner.tier)
        self.rng = torch.Generator(device=self.device)
        self.rng.manual_seed(cfg.seed)
        self.requests: dict[str, Sequence] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        # sparse miss_estimate: the selecting layers, and per decoded sequence and step the layers' mean estimate
        # (drained by the server's metrics; bounded, so an engine without a reader does not grow)
        self.miss_layers = [m for m in getattr(self.runner, "sparse_layers", []) if not m.dense_layer] \
            if cfg.sparse.sparse and cfg.sparse.miss_estimate else []
        self.miss_estimates: deque[float] = deque(maxlen=4096)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do on one device). Idempotent."""
        self._unfreeze_gc()
        if self.workers is not None:
            self.workers.shutdown()

    @staticmethod
    def _unfreeze_gc() -> None:
        """Frozen objects return to the collected generations (a sequence finished: its lists may be garbage
        in cycles, and an engine dropped later must be collectable)."""
        if FREEZE_GC:
            gc.unfreeze()

    @staticmethod
    def _generation_eos(path: str) -> set[int]:
        f = os.path.join(path, "generation_config.json")
        if not os.path.isfile(f):
            return set()
        with open(f) as fh:
            eos = json.load(fh).get("eos_token_id")
        return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise RequestError("this model has no tokenizer: give prompt token ids")
        if params.stop and self.tokenizer is None:
            raise RequestError("this model has no tokenizer: stop strings need one (use stop_token_ids)")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_len = self.cfg.scheduler.max_model_len
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= max_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model's context limit is {max_len} "
                               f"(prompt + at least one generated token)")
        if max(ids) >= self.model_config.vocab_size or min(ids) < 0:
            raise RequestError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        seq = Sequence(ids, params, request_id=request_id or "")
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer)
        if seq.request_id in self.requests:
            raise RequestError(f"request id {seq.request_id!r} is already in flight")
        if self.runner.tier is not None:
            self.runner.tier.check(seq)  # CapacityError: the request can never fit the tier's budgets
        if FREEZE_GC:
            gc.freeze()
        seq.generator = torch.Generator(device=self.device)
        seq.generator.manual_seed(params.seed if params.seed is not None
                                  else int(torch.randint(2**62, (1,), generator=self.rng, device=self.device)))
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            self._unfreeze_gc()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns an output for every sequence that got a new token."""
        with self.phase("scheduler.schedule"):
            batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                raise RequestError(f"request {seq.request_id}: {len(seq)} tokens do not fit the KV cache "
                                   f"({self.blocks.num_blocks - 1} blocks of {self.blocks.block_size})")
            return []
        spec = self.runner.spec
        if spec is not None:
            with self.phase("spec.propose"):  # named ranges for torch.profiler (bench_mtp.py --profile)
                spec.propose(batch)  # draft tokens for the running sequences given 1 + k rows
        starts = [seq.num_cached for seq, _ in batch]
        ends = [i for i, (seq, n) in enumerate(batch) if seq.num_cached + n - seq.num_drafts(n) == len(seq)]
        done = [batch[i][0] for i in ends]  # sequences that get new tokens this step
        with self.phase("runner.run"):
            out = self.runner.run(batch)
        if isinstance(out, SampleOutput):
            if self.miss_layers:
                self._read_miss_estimates(batch, starts)
            out = VerifyOutput.from_sample(out)
            with self.phase("engine.after_step"):
                self._after_run(batch)
        else:  # speculative: accepted drafts join the cache, rejected rows roll back
            advance = [n - seq.num_drafts(n) for seq, n in batch]
            for i, a in zip(ends, out.num_accepted):
                advance[i] += a
            for seq, toks in zip(done, out.tokens):
                seq.token_ids += toks[:-1]
            # prefix-cache snapshot points inside the kept runs: (sequence, position, verified row t)
            snaps = [(seq, pos, pos - s - 1) for (seq, _), s, a in zip(batch, starts, advance)
                     for pos in range(s + 1, s + a) if self.scheduler.snapshot_point(seq, pos)]

            def catch_up():
                for seq, toks in zip(done, out.tokens):
                    seq.token_ids.append(toks[-1])  # pending, like a sampled token; the drafter reads it
                with self.phase("spec.catch_up"):
                    spec.catch_up(batch, starts)
                for seq, toks in zip(done, out.tokens):  # emitted one by one below, through the stop checks
                    del seq.token_ids[len(seq) - len(toks):]

            with self.phase("spec.commit"):
                spec.commit(done, out, {(seq.state_slot, t) for seq, _, t in snaps})   # keeps those states
            with self.phase("engine.after_step"):
                self._after_run(batch, advance, snaps, catch_up)
            self.stats.update({k: v for k, v in spec.metrics().items() if not isinstance(v, list)})
        with self.phase("engine.outputs"):
            return self._outputs(done, out)

    def _outputs(self, done: list[Sequence], out: VerifyOutput) -> list[RequestOutput]:
        """Append each sequence's new tokens through the stop checks; one output per sequence."""
        outputs = []
        for i, seq in enumerate(done):
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
                self.stats["prompt_tokens"] += seq.num_prompt_tokens
            for tok, lp, top in zip(out.tokens[i], out.logprobs[i], out.top_logprobs[i]):
                seq.token_ids.append(tok)
                if seq.detok is not None:
                    seq.detok.add(tok)
                self.stats["generation_tokens"] += 1
                if lp is not None:
                    seq.logprobs.append(lp)
                    seq.top_logprobs.append(top)
                self._check_stop(seq)
                if seq.is_finished:  # tokens after a stop are dropped
                    break
            outputs.append(self._output(seq))
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
                self._unfreeze_gc()
        return outputs

    def _after_run(self, batch, advance: list[int] | None = None,
                   snapshots: list[tuple[Sequence, int, int]] = (), catch_up=None) -> None:
        """Caches advanced by one step: register blocks, save due GDN snapshots, log long prefills.
        snapshots: (sequence, position, verified row) of snapshot points passed inside a verified run (their
        states were kept by Speculator.commit). catch_up: the drafter's pass over the kept rows, run once the
        scheduler has counted them and before the snapshots are taken (they hold the drafter's K/V ring)."""
        self.scheduler.after_step(batch, advance)
        if catch_up is not None:
            catch_up()
        for seq, pos, t in snapshots:   # after after_step: the blocks' hashes are registered now
            self.runner.state_cache.save(seq.block_hashes[pos // self.blocks.block_size - 1],
                                         self.runner.spec.slot_states(seq.state_slot, t))
        for seq, n in batch:  # the slot now holds the state after exactly num_cached tokens
            if n > 1 and len(seq) >= LONG_PREFILL:
                took = time.monotonic() - seq.arrival
                logger.info("request %s: prefill %d/%d tokens (%.0f tok/s since arrival)", seq.request_id,
                            seq.num_cached, len(seq), (seq.num_cached - seq.num_prompt_cached) / max(took, 1e-6))
            if self.scheduler.snapshot_point(seq, seq.num_cached):
                self.runner.save_state(seq.block_hashes[-1], seq.state_slot)
        self.stats["steps"] += 1
        self.stats["prefix_cache_queries"] = self.scheduler.prefix_queries
        self.stats["prefix_cache_hits"] = self.scheduler.prefix_hits

    def _read_miss_estimates(self, batch, starts: list[int]) -> None:
        """The step's missed-mass estimates, mean over the layers that selected, per decoded sequence. Read after
        sampling has synchronised with the device: one small copy, no stall (speculative steps are not recorded)."""
        rows = sum(1 for (seq, n), s in zip(batch, starts) if n == 1 and s > 0)   # the decode rows, in row order
        if not rows or any(m.miss_rows.shape[0] < rows for m in self.miss_layers):
            return
        est = torch.stack([m.miss_rows[:rows] for m in self.miss_layers]).cpu()   # [layers, rows]; -1: read all
        for col in est.T:
            picked = col[col >= 0]
            if len(picked):
                self.miss_estimates.append(float(picked.mean()))

    # ---- host tier -----------------------------------------------------------------------------
    def tier_stats(self):
        """Host tier totals (TierStats: hits, misses, PCIe bytes read / written since start, host and
        GPU bytes allocated; one host sync), or None without the tier."""
        return self.runner.tier.stats() if self.runner.tier is not None else None

    def tier_sequence_stats(self) -> dict:
        """{request_id: TierStats(host_bytes, gpu_bytes)} of the sequences holding tier memory now."""
        tier = self.runner.tier
        if tier is None:
            return {}
        seqs = list(self.scheduler.running) + [s for s in self.scheduler.waiting if s.state_slot >= 0]
        return {s.request_id: tier.seq_stats(s) for s in seqs}

    def teacher_force(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
        """Log-probabilities [len(cont), vocab] (fp32, on the CPU) that the model assigns at each
        continuation position when fed the given tokens instead of its own: prefill the prompt,
        then one decode step per continuation token, in batches like any other request. Sparse
        decode, the host tier and CUDA graphs apply exactly as in generation."""
        sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
        seqs = [self.add_request(p, sp) for p in prompts]
        want = {s.seq_id: c for s, c in zip(seqs, continuations)}
        rows: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        while any(not s.is_finished for s in seqs):
            batch = self.scheduler.schedule()
            if not batch:
                raise RequestError("teacher forcing: a sequence does not fit the KV cache")
            logits = self.runner.run(batch, sample_now=False)
            self._after_run(batch)
            done = [seq for seq, n in batch if seq.num_cached == len(seq)]
            for seq, row in zip(done, torch.log_softmax(logits.float(), -1).cpu()):
                got, cont = rows[seq.seq_id], want[seq.seq_id]
                got.append(row)
                if len(got) == len(cont):
                    seq.finish_reason = "length"
                    self.scheduler.finish(seq)
                    self.requests.pop(seq.request_id, None)
                    self._unfreeze_gc()
                else:
                    seq.token_ids.append(cont[len(got) - 1])
        return [torch.stack(rows[s.seq_id]) for s in seqs]

    def _check_stop(self, seq: Sequence) -> None:
        p, tok, n_out = seq.params, seq.token_ids[-1], len(seq.output_token_ids)
        reason = None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                reason, seq.stop_reason = "stop", None
            elif tok in p.stop_token_ids:
                reason, seq.stop_reason = "stop", tok
            elif p.stop and self._stop_string(seq) is not None:
                reason = "stop"
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens)
                               or len(seq) >= self.cfg.scheduler.max_model_len):
            reason = "length"
        if reason:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _stop_string(self, seq: Sequence) -> str | None:
        s = seq.detok.find_stop(seq.params.stop) if seq.detok is not None else None
        if s is not None:
            seq.stop_reason = s
        return s

    def output_text(self, seq: Sequence) -> str:
        """The text so far: while running, up to the last whole character (always a prefix of the final
        text); once finished, all of it (a trailing incomplete character as U+FFFD), cut at the stop string."""
        if seq.detok is None:
            return ""
        if not seq.is_finished:
            return seq.detok.text
        text = seq.detok.finish()
        if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
            cut = text.find(seq.stop_reason)
            if cut >= 0:
                text = text[:cut + (len(seq.stop_reason) if seq.params.include_stop_str_in_output else 0)]
        return text

    def _output(self, seq: Sequence) -> RequestOutput:
        want_lp = seq.params.logprobs is not None
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            text=self.output_text(seq), finished=seq.is_finished, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, logprobs=seq.logprobs if want_lp else None,
            top_logprobs=seq.top_logprobs if want_lp else None, num_cached_tokens=seq.num_prompt_cached)
