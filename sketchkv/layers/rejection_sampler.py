"""Speculative verification: which draft tokens to keep, and the token that follows them.

Greedy (temperature 0): keep drafts while each equals the target's argmax at its position; the next
token is the target's argmax after the last kept draft, so the output is the non-speculative one.
Sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft
i, drawn from q_i, is kept with probability min(1, p_i(d) / q_i(d)); at the first rejection the
token is drawn from norm(max(0, p_i - q_i)); if all are kept, a bonus token is drawn from p_k. p is
the target's filtered distribution (temperature, top-k/p, min-p), exactly what `sample` draws from,
so each emitted token follows the non-speculative distribution.
"""
from dataclasses import dataclass, field

import torch

from sketchkv.layers.sampler import SampleOutput, _filter
from sketchkv.sampling_params import SamplingParams


@dataclass
class VerifyOutput:
    """Per sequence that completed its tokens: the tokens to append (accepted drafts + one more)."""
    tokens: list[list[int]]
    logprobs: list[list[float | None]]
    top_logprobs: list[list[list[tuple[int, float]] | None]]
    num_drafts: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)

    @classmethod
    def from_sample(cls, out: SampleOutput) -> "VerifyOutput":
        n = len(out.tokens)
        return cls([[t] for t in out.tokens], [[lp] for lp in out.logprobs], [[tp] for tp in out.top_logprobs],
                   [0] * n, [0] * n)


def accept_greedy(best: list[int], drafts: list[int]) -> list[int]:
    """best [k+1]: the target's argmax at the last token and at each draft -> the kept drafts, then the
    target's token after them."""
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return drafts[:a] + [best[a]]


def accept(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, p: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [k+1, V] of the target at the last token and at each draft; drafts [k]; draft_probs
    [k, V] (the distributions the drafts were drawn from; None: drafts were argmaxes, one-hot) ->
    the tokens to emit: the kept drafts then one token from the target (1 to k+1 tokens)."""
    k = len(drafts)
    if p.greedy:
        return accept_greedy(torch.argmax(logits, -1).tolist(), drafts)
    probs = torch.stack([torch.softmax(_filter(logits[i].float(), p), -1) for i in range(k + 1)])
    if draft_probs is None:
        draft_probs = torch.zeros(k, logits.shape[-1], device=logits.device)
        draft_probs[torch.arange(k), torch.tensor(drafts, dtype=torch.long, device=logits.device)] = 1.0
    u = torch.rand(k, generator=generator, device=logits.device).tolist()
    for i, d in enumerate(drafts):
        pd, qd = probs[i, d].item(), draft_probs[i, d].item()
        if u[i] * qd < pd:  # accept with probability min(1, p(d) / q(d))
            continue
        residual = (probs[i] - draft_probs[i].to(probs.dtype)).clamp_min(0)
        if residual.sum() <= 0:  # p == q up to rounding: the residual is empty, p itself is exact
            residual = probs[i]
        tok = torch.multinomial(residual / residual.sum(), 1, generator=generator).item()
        return drafts[:i] + [tok]
    return drafts + [torch.multinomial(probs[k], 1, generator=generator).item()]


def verify(logits: torch.Tensor, spans: list[tuple[int, int]], drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None], params: list[SamplingParams], generators: list) -> VerifyOutput:
    """One acceptance per sequence (rows logits[a:a + k_i + 1] for span (a, k_i + 1): its last token and
    its drafts), plus logprobs of the emitted tokens under the target's raw distribution at their
    positions, as `sample` reports them. The argmaxes of all greedy sequences come to the host in one
    sync (a sync per sequence kept a launch-bound GPU idle, H200 run 62)."""
    out = VerifyOutput([], [], [], [], [])
    best = torch.argmax(logits, -1).tolist() if any(p.greedy for p in params) else None
    for (a, m), d, q, p, g in zip(spans, drafts, draft_probs, params, generators):
        lg = logits[a:a + m]
        toks = accept_greedy(best[a:a + m], d) if p.greedy else accept(lg.float(), d, q, p, g)
        out.tokens.append(toks)
        out.num_drafts.append(len(d))
        out.num_accepted.append(len(toks) - 1)
        if p.logprobs is None:
            out.logprobs.append([None] * len(toks))
            out.top_logprobs.append([None] * len(toks))
            continue
        logp = torch.log_softmax(lg[:len(toks)].float(), -1)
        chosen = logp.gather(1, torch.tensor(toks, device=lg.device)[:, None])[:, 0].tolist()
        out.logprobs.append(chosen)
        if p.logprobs:
            tv, ti = torch.topk(logp, p.logprobs, dim=-1)
            out.top_logprobs.append([list(zip(i, v)) for i, v in zip(ti.tolist(), tv.tolist())])
        else:
            out.top_logprobs.append([[] for _ in toks])
    return out
