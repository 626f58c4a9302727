"""Token sampling: greedy, temperature, top-k, top-p, min-p; per-request seeded RNG; logprobs."""
from dataclasses import dataclass

import torch

from sketchkv.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float | None]                       # chosen token's logprob (raw model distribution)
    top_logprobs: list[list[tuple[int, float]] | None]  # the n most likely tokens, when asked for


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p as -inf masks on one row."""
    x = logits / p.temperature
    if p.top_k and 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, -1) > p.top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> SampleOutput:
    """logits [B, V] -> one token per row. Each row samples with its own generator, so a seeded
    request gets the same tokens whatever else is in the batch."""
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            probs = torch.softmax(_filter(logits[i], p), -1)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    want = [p.logprobs is not None for p in params]
    lp, top = [None] * len(params), [None] * len(params)
    if any(want):
        logp = torch.log_softmax(logits, -1)
        chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
        n_top = max(p.logprobs or 0 for p in params)
        if n_top:
            tv, ti = torch.topk(logp, n_top, dim=-1)
            tv, ti = tv.tolist(), ti.tolist()
        for i, p in enumerate(params):
            if want[i]:
                lp[i] = chosen[i]
                top[i] = list(zip(ti[i][:p.logprobs], tv[i][:p.logprobs])) if p.logprobs else []
    return SampleOutput(tokens.tolist(), lp, top)
