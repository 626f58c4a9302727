"""Decides which sequences run each step and how many of their tokens.

Continuous batching with chunked prefill: every running sequence decodes one token, then the
remaining token budget of the step goes to prompt chunks (several prompts may advance in one
step). A chunk over a long context takes seconds (attention over 250K tokens of prefix), so while
sequences decode, prompt chunks are capped (max_prefill_tokens_while_decoding) and steps that carry
one alternate with decode-only steps by wall time (decode_time_share): a long prefill slows the
others' decode by a known share instead of stalling it for its whole length. When KV blocks run out, the newest
running sequence is preempted by recompute: its blocks and state slot are freed and it returns
to the front of the queue with every token it has (prompt + generated), so nothing is lost.
"""
import time
from collections import deque

from sketchkv.config import SchedulerConfig
from sketchkv.engine.sequence import Sequence, Status
from sketchkv.kv.block_manager import BlockManager
from sketchkv.kv.state_cache import StateCache


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, num_state_slots: int,
                 prefix_caching: bool = False, states: StateCache | None = None, snapshot_interval: int = 0,
                 num_speculative_tokens: int = 0, tier=None):
        """states: GDN snapshots (hybrid models; None for dense models, whose KV alone is the state).
        snapshot_interval: tokens between GDN snapshots (a multiple of the block size; 0 = only at
        each prompt's last block boundary). num_speculative_tokens: drafts per running sequence
        and step (fewer near its token limits or when blocks run short). tier: the host KV tier (its
        hot-buffer partitions are GPU memory a sequence holds while it has a state slot; a sequence
        waits until one is free)."""
        self.cfg = cfg
        self.num_spec = num_speculative_tokens
        self.blocks = blocks
        self.tier = tier
        self.prefix_caching, self.states, self.snapshot_interval = prefix_caching, states, snapshot_interval
        self.prefix_queries = self.prefix_hits = 0
        self.free_slots = deque(range(num_state_slots))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # prompt fully cached; decoding
        self.num_preemptions = 0
        # decode/prefill time sharing: seconds decode-only steps are owed (< 0) or ahead (>= 0) while
        # both kinds of work wait; a step carrying prompt tokens may run when it is >= 0
        self._balance = 0.0
        self._step_start: float | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of new tokens to run) for this step."""
        batch: list[tuple[Sequence, int]] = []
        budget = self.cfg.max_num_batched_tokens
        self._step_start = time.perf_counter()
        for seq in list(self.running):
            if seq not in self.running:          # preempted below by an older sequence
                continue
            while not self.blocks.can_grow(seq, len(seq)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            k = self._num_drafts(seq, budget)
            self.blocks.grow(seq, len(seq) + k)
            batch.append((seq, 1 + k))
            budget -= 1 + k
        in_flight = len(self.running)
        if batch and self.waiting and self.cfg.decode_time_share > 0:
            if self._balance < 0:
                return batch                     # a decode-only step: prefill had its share
            budget = min(budget, self.cfg.max_prefill_tokens_while_decoding)
        else:
            self._balance = 0.0
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if seq.state_slot < 0:
                if in_flight >= self.cfg.max_num_seqs or not self.free_slots:
                    break
                if self.tier is not None and not self.tier.can_add(seq):
                    break
                seq.state_slot = self.free_slots.popleft()
                if self.tier is not None:
                    self.tier.add(seq)
                if self.prefix_caching and not seq.block_table:
                    self._reuse_prefix(seq)
            n = self._chunk(seq, budget)
            if not self.blocks.can_grow(seq, seq.num_cached + n):
                if seq.num_cached == 0 and not seq.block_table:
                    self.free_slots.appendleft(seq.state_slot)
                    seq.state_slot = -1
                    if self.tier is not None:
                        self.tier.remove(seq)
                break
            self.blocks.grow(seq, seq.num_cached + n)
            batch.append((seq, n))
            budget -= n
            in_flight += 1
        return batch

    def _share_time(self, batch) -> None:
        """Charge the step's wall time to decode (credit) or to prefill (debt) while both wait."""
        if self._step_start is None or not self.running or not self.waiting:
            return
        dt, share = time.perf_counter() - self._step_start, self.cfg.decode_time_share
        if any(seq.status == Status.WAITING for seq, _ in batch):
            self._balance -= dt * share
        else:  # no credit beyond one step: a long decode-only stretch buys no long prefill burst later
            self._balance = min(self._balance + dt * (1 - share), dt * (1 - share))

    def _num_drafts(self, seq: Sequence, budget: int) -> int:
        """Draft tokens to verify after seq's last token this step (0: plain decode)."""
        if not self.num_spec or not seq.spec_ready:
            return 0
        # Not cut at max_tokens: tokens past it (or past a stop) are dropped when emitted, and a step whose
        # every sequence verifies exactly n drafts replays a verification graph, where one sequence near its
        # end with fewer would send the whole batch down the eager path (a quarter of the steps of 8 x 128
        # tokens at n = 7: 873 tok/s against 4,783 without speculation, H200 run 23).
        k = min(self.num_spec, self.cfg.max_model_len - len(seq), budget - 1)
        return k if k > 0 and self.blocks.can_grow(seq, len(seq) + k) else 0

    # ---- prefix cache --------------------------------------------------------------------------
    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start from the longest cached prefix (leaving >= 1 token to compute for the logits). On a
        hybrid model only up to a boundary whose GDN state was saved."""
        matched = self.blocks.match(seq.token_ids[:len(seq) - 1])
        if self.states is not None:
            while matched and matched[-1][1] not in self.states:
                matched.pop()
        first = seq.num_prompt_cached == 0 and seq.first_token_time is None
        if matched:
            self.blocks.share(seq, matched)
            seq.restore_hash = matched[-1][1] if self.states is not None else None
        if first:
            seq.num_prompt_cached = seq.num_cached
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_cached

    def snapshot_point(self, seq: Sequence, pos: int) -> bool:
        """Is the GDN state after `pos` tokens one to save?"""
        if self.states is None or not self.prefix_caching or pos == 0 or pos % self.blocks.block_size:
            return False
        last_prompt_boundary = seq.num_prompt_tokens // self.blocks.block_size * self.blocks.block_size
        return pos == last_prompt_boundary or (self.snapshot_interval > 0 and pos % self.snapshot_interval == 0)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill chunk size; on hybrid models a chunk stops at the next snapshot point."""
        n = min(seq.num_uncached, budget)
        if self.states is not None and self.prefix_caching:
            bs = self.blocks.block_size
            for pos in range((seq.num_cached // bs + 1) * bs, seq.num_cached + n, bs):
                if self.snapshot_point(seq, pos):
                    return pos - seq.num_cached
        return n

    def after_step(self, batch: list[tuple[Sequence, int]], advance: list[int] | None = None) -> None:
        """Advance caches; a sequence whose prompt is now fully cached joins the running set.
        advance: tokens now cached per sequence when not all of its rows were kept (speculative
        steps: the accepted drafts are already appended, the step's new token not yet); blocks that
        only rejected rows used are freed."""
        self._share_time(batch)
        for i, (seq, n) in enumerate(batch):
            if advance is not None:
                n = advance[i]
                self.blocks.shrink(seq, seq.num_cached + n + 1)  # cached tokens + the pending one
            seq.num_cached += n
            if self.prefix_caching:
                self.blocks.register(seq)
            if seq.status == Status.WAITING and seq.num_uncached == 0:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_cached = 0
        seq.spec_ready, seq.mtp_hidden = False, None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        if self.tier is not None:
            self.tier.remove(seq)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
