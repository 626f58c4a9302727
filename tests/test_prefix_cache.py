"""Prefix caching across requests and turns: shared KV blocks, GDN state snapshots, LRU reuse."""
import pytest
import torch

from sketchkv import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_follow_up_turn_reuses_prefix_and_matches_uncached(tiny_checkpoint, model_type):
    path, _ = tiny_checkpoint(model_type)
    cached = LLM(path, device="cpu", block_size=16, max_num_batched_tokens=128)
    plain = LLM(path, device="cpu", block_size=16, enable_prefix_caching=False)
    turn1 = _ids(300, 1)
    out1 = cached.generate(prompt_token_ids=[turn1], sampling_params=GREEDY)[0]
    assert out1.num_cached_tokens == 0
    turn2 = turn1 + out1.token_ids + _ids(50, 2)            # the agent re-sends everything
    out2 = cached.generate(prompt_token_ids=[turn2], sampling_params=GREEDY)[0]
    # hybrid: up to the saved state at the last block boundary of turn 1's prompt; dense: any full block
    expect = (300 // 16) * 16 if model_type == "qwen3_5_text" else (len(turn1) + 19) // 16 * 16
    assert out2.num_cached_tokens == expect
    assert out2.token_ids == plain.generate(prompt_token_ids=[turn2], sampling_params=GREEDY)[0].token_ids
    stats = cached.engine.stats
    assert stats["prefix_cache_hits"] == expect and stats["prefix_cache_queries"] == len(turn1) + len(turn2)


def test_snapshot_interval_allows_hits_inside_a_prompt(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5_text")
    llm = LLM(path, device="cpu", block_size=16, snapshot_interval_blocks=4, max_num_batched_tokens=512)
    base = _ids(400, 3)
    llm.generate(prompt_token_ids=[base], sampling_params=GREEDY)
    branch = base[:200] + _ids(100, 4)                       # diverges at token 200
    out = llm.generate(prompt_token_ids=[branch], sampling_params=GREEDY)[0]
    assert out.num_cached_tokens == 192                      # last snapshot (every 64 tokens) before 200
    ref = LLM(path, device="cpu", block_size=16, enable_prefix_caching=False)
    assert out.token_ids == ref.generate(prompt_token_ids=[branch], sampling_params=GREEDY)[0].token_ids


def test_lru_reuse_under_a_small_cache_stays_correct(tiny_checkpoint):
    """Many prompts through a cache that cannot hold them all: freed blocks are reused, revived
    prefixes still give the uncached result."""
    path, _ = tiny_checkpoint("qwen3")
    small = LLM(path, device="cpu", block_size=16, num_kv_blocks=40, max_num_batched_tokens=128)
    plain = LLM(path, device="cpu", block_size=16, enable_prefix_caching=False)
    shared = _ids(100, 5)
    prompts = [shared + _ids(60, 10 + i) for i in range(6)] + [shared + _ids(60, 10)]
    for p in prompts:
        a = small.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
        b = plain.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0]
        assert a.token_ids == b.token_ids
    assert small.engine.stats["prefix_cache_hits"] > 0
