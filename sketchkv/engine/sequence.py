"""One request's tokens and bookkeeping as it moves through the engine."""
import enum
import itertools
import time
from dataclasses import dataclass, field

from sketchkv.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # needs (more) prefill
    RUNNING = "running"      # prompt done, decoding
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
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

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
