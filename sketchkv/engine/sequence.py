"""One request's tokens and bookkeeping as it moves through the engine."""
import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from sketchkv.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # needs (more) prefill
    RUNNING = "running"      # prompt done, decoding
    FINISHED = "finished"


_ids = itertools.count()


# eq=False: sequences compare by identity. The dataclass __eq__ compared whole token lists, so the scheduler's
# `seq in running` cost O(context) per sequence and step when agents share a long prompt (2.4 ms per step at
# 8 x 128K identical prompts on a CPU core).
@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_cached: int = 0                                   # tokens whose KV/state are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hash of each full computed block
    restore_hash: int | None = None                       # GDN state snapshot to load before the next step
    state_slot: int = -1
    status: Status = Status.WAITING
    finish_reason: str | None = None                      # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_prompt_cached: int = 0                            # prompt tokens served from the prefix cache
    generator: object = None                              # torch.Generator, set by the engine
    detok: object = None                                  # IncrementalDetokenizer (engine; None: no tokenizer)
    # Speculative decoding (engine/speculative.py)
    spec_ready: bool = False                              # the drafter has caught up: drafts may be scheduled
    draft_token_ids: list[int] = field(default_factory=list)  # drafts verified in this step, after the last token
    draft_probs: object = None                            # [k, vocab] draft distribution (sampling), or None (greedy)
    mtp_hidden: object = None                             # drafter state after the last computed token
    tier_pid: int = -1                                    # host tier: its hot-buffer partition
    # block_table as an int32 tensor, extended as the table grows (block_table_tensor): a 1M-token
    # sequence's table is 16K entries, ~1.5 ms per step to convert from the list (H200 run 21, QSA)
    _bt: object = field(default=None, repr=False, compare=False)
    _bt_list: object = field(default=None, repr=False, compare=False)  # the list _bt mirrors (another: rebuild)
    _bt_valid: int = field(default=0, repr=False, compare=False)       # leading entries equal to block_table's

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.request_id:
            self.request_id = str(self.seq_id)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached

    def step_token_ids(self, n: int) -> list[int]:
        """The `n` tokens a step runs: uncached tokens, then the drafts that follow the last one."""
        return (self.token_ids[self.num_cached:self.num_cached + n] + self.draft_token_ids)[:n]

    def num_drafts(self, n: int) -> int:
        """Draft tokens in a step that runs `n` tokens of this sequence (0 for prefill chunks)."""
        return max(0, n - self.num_uncached)

    def block_table_tensor(self) -> torch.Tensor:
        """block_table as an int32 CPU tensor. BlockManager edits tables only at their tail (append; pop in
        shrink, which calls table_truncated) or replaces them, so only new entries are converted."""
        with torch.inference_mode(False):  # a normal tensor: updated both inside and outside inference mode
            return self._block_table_tensor()

    def _block_table_tensor(self) -> torch.Tensor:
        n = len(self.block_table)
        if self._bt_list is not self.block_table:
            self._bt_list, self._bt_valid = self.block_table, 0
        if self._bt is None or self._bt.numel() < n:
            grown = torch.empty(max(n, 2 * (0 if self._bt is None else self._bt.numel()), 64), dtype=torch.int32)
            if self._bt_valid:
                grown[:self._bt_valid] = self._bt[:self._bt_valid]
            self._bt = grown
        v = min(self._bt_valid, n)
        if v < n:
            self._bt[v:n] = torch.tensor(self.block_table[v:n], dtype=torch.int32)
        self._bt_valid = n
        return self._bt[:n]

    def table_truncated(self) -> None:
        """The table lost tail entries (entries appended later differ from the tensor's)."""
        self._bt_valid = min(self._bt_valid, len(self.block_table))

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED


def block_tables(seqs: list[Sequence], width: int | None = None, pad: int = -1) -> torch.Tensor:
    """The sequences' block tables as one int32 CPU tensor [B, width], padded with `pad`."""
    width = max(len(s.block_table) for s in seqs) if width is None else width
    out = torch.full((len(seqs), width), pad, dtype=torch.int32)
    for i, s in enumerate(seqs):
        out[i, :len(s.block_table)] = s.block_table_tensor()
    return out
