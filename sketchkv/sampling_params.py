"""Per-request sampling knobs, in vLLM's shape."""
from dataclasses import dataclass, field

from sketchkv.errors import RequestError


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1               # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None       # per-request RNG: same seed, same tokens
    max_tokens: int | None = 16   # None: up to the model's context limit
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None   # None: none; 0: chosen token's logprob; n: plus the n most likely
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
