"""Decides which sequences run each step and how many of their tokens.

Continuous batching with chunked prefill: every running sequence decodes one token, then the
remaining token budget of the step goes to prompt chunks (several prompts may advance in one
step), so a long prefill never stalls the others' decode. When KV blocks run out, the newest
running sequence is preempted by recompute: its blocks and state slot are freed and it returns
to the front of the queue with every token it has (prompt + generated), so nothing is lost.
"""
from collections import deque

from sketchkv.config import SchedulerConfig
from sketchkv.engine.sequence import Sequence, Status
from sketchkv.kv.block_manager import BlockManager


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, num_state_slots: int):
        self.cfg = cfg
        self.blocks = blocks
        self.free_slots = deque(range(num_state_slots))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # prompt fully cached; decoding
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of new tokens to run) for this step."""
        batch: list[tuple[Sequence, int]] = []
        budget = self.cfg.max_num_batched_tokens
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
            self.blocks.grow(seq, len(seq))
            batch.append((seq, 1))
            budget -= 1
        in_flight = len(self.running)
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if seq.state_slot < 0:
                if in_flight >= self.cfg.max_num_seqs or not self.free_slots:
                    break
                seq.state_slot = self.free_slots.popleft()
            n = min(seq.num_uncached, budget)
            if not self.blocks.can_grow(seq, seq.num_cached + n):
                if seq.num_cached == 0 and not seq.block_table:
                    self.free_slots.appendleft(seq.state_slot)
                    seq.state_slot = -1
                break
            self.blocks.grow(seq, seq.num_cached + n)
            batch.append((seq, n))
            budget -= n
            in_flight += 1
        return batch

    def after_step(self, batch: list[tuple[Sequence, int]]) -> None:
        """Advance caches; a sequence whose prompt is now fully cached joins the running set."""
        for seq, n in batch:
            seq.num_cached += n
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
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
