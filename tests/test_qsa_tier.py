"""qwen4_exp over the host KV tier: QSA selects, the indexed layers' main K/V live in host RAM.

The tier changes where K/V rows live, never which rows a query reads: QSA scores the pooled block keys,
which stay on the GPU in the model dtype. So with host rows in the model's own precision the tier reads
back exactly the values tier-off keeps on the device: a bf16 model with bf16 host rows must give
identical tokens and log-probabilities. With an fp32 model, bf16 host rows round the picked K/V
(relative 2^-9), which moves log-probabilities by ~2e-5 here (random weights, flat distributions):
tokens must match, values within 2e-4.
int4 / int8 rows would change numerics by their quantisation error; tests/test_tier_engine.py bounds that.

The tiny config (conftest.TINY["qwen4_exp_text"]) has a QSA budget of 32 tokens (8 blocks of 4), so with
100-300 token contexts decode and later prefill chunks really prune.
"""
import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.errors import RequestError
from sketchkv.layers.tiered_attention import TieredIndexedAttention

TIER = dict(sparse_host_tier=True, sparse_host_format="bf16", sparse_sink_tokens=4, sparse_recent_tokens=8)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, tier: bool, dtype="bfloat16", **kw):
    opts = dict(device="cpu", dtype=dtype, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    return LLM(path, **{**opts, **(TIER if tier else {}), **kw})


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    from conftest import make_checkpoint
    path = str(tmp_path_factory.mktemp("q4t") / "qwen4_exp")
    make_checkpoint(path, "qwen4_exp_text")
    return path


def test_tier_bf16_rows_bf16_model_identical_to_tier_off(qwen4):
    """Batched sequences of different lengths, 64-token prefill chunks (later chunks read their prefix
    back from the tier; prompt chunks and decode rows share steps), QSA decode through the tier (hot
    hits and host misses), then a follow-up turn from the prefix cache: identical to tier-off."""
    prompts = [_prompt(300, 1), _prompt(150, 2), _prompt(21, 3)]
    follow = prompts[0] + _prompt(40, 4)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = []
    for tier in (False, True):
        llm = _llm(qwen4, tier)
        a = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        b = llm.generate(prompt_token_ids=[follow], sampling_params=sp)[0]
        assert b.num_cached_tokens >= 288
        outs.append([(o.token_ids, o.logprobs) for o in a + [b]])
        if tier:
            runner = llm.engine.runner
            assert all(isinstance(m, TieredIndexedAttention) and m.k_cache.numel() == 0 for m in runner.qsa_layers)
            _, counts = runner.qsa_layers[0].last_indices  # the last step really pruned
            assert int(counts.max()) <= 32 + 3 < len(follow)
            s = llm.tier_stats()
            assert s.hits > 0 and s.misses > 0 and s.pcie_read_bytes > 0
    assert outs[0] == outs[1]


def test_tier_fp32_teacher_forced_logprobs_match_tier_off(qwen4):
    """fp32 model, bf16 host rows: teacher-forced continuations (QSA decode at every position) agree
    with tier-off in argmax, log-probabilities within bf16 rounding of the picked K/V."""
    prompts, conts = [_prompt(260, 5), _prompt(90, 6)], [_prompt(30, 7), _prompt(30, 8)]
    ref = _llm(qwen4, False, dtype="float32").teacher_force(prompts, conts)
    got = _llm(qwen4, True, dtype="float32").teacher_force(prompts, conts)
    for a, b in zip(ref, got):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(b, a, rtol=0, atol=2e-4)


def test_gpu_bytes_per_token_per_indexed_layer(tmp_path):
    """The seed's figure at its indexer shape (D = 128, c = 4, bf16): with the tier an indexed layer keeps
    64 B of block key + a 2-byte hot slot-map entry per token on the GPU = 66 B; everything else is per
    sequence (raw index tail, sinks + recent ring) or the hot pool (a cache sized by sparse_hot_fraction).
    Measured from the allocated buffers, against tier-off (+ 2 x Hkv x D x 2 B of K/V per token)."""
    from conftest import make_checkpoint
    path = str(tmp_path / "q4_d128")
    make_checkpoint(path, "qwen4_exp_text", indexer_head_dim=128)
    off = _llm(path, False).qsa_memory()
    llm = _llm(path, True)
    on, runner = llm.qsa_memory(), llm.engine.runner
    c = runner.model_cfg
    kv_row = 2 * c.num_kv_heads * c.head_dim * 2
    assert off["index_bytes_per_token"] == on["index_bytes_per_token"] == 128 * 2 / 4
    assert off["kv_bytes_per_token"] == kv_row and on["kv_bytes_per_token"] == 0
    assert runner.tier.hot.map.dtype == torch.int16 and on["slot_map_bytes_per_token"] == 2
    assert on["gpu_bytes_per_token"] == 66 <= 66
    assert on["tail_state_bytes_per_seq"] == 4 * 128 * 2
    assert on["resident_state_bytes_per_seq"] == (4 + 8) * kv_row
    # the tier's accounting (LLM.tier_stats().gpu_bytes) charges exactly the allocated block keys
    keys = sum((m.index_keys.numel() - m.index_keys.shape[-1]) * 2 for m in runner.qsa_layers)  # minus dump rows
    assert runner.num_blocks * runner.selector_bytes_per_block == keys
    assert llm.tier_stats().gpu_bytes == runner.tier.gpu_bytes >= keys + runner.tier.hot.map.numel() * 2


def test_sketch_sparse_still_refused_tier_needs_nothing_else(qwen4):
    with pytest.raises(RequestError, match="sparse_host_tier=True"):
        _llm(qwen4, False, sparse=True)
    with pytest.raises(RequestError, match="speculative"):
        _llm(qwen4, True, num_speculative_tokens=1)


def test_tier_decode_in_groups_same_tokens(qwen4, monkeypatch):
    """sparse_read_groups (forced on here: the runner keeps 1 on CPU) through QSA selection: 3 sequences in 2 groups
    give the tokens and log-probabilities of one group, and the grouped path really ran."""
    calls = []
    grouped = TieredIndexedAttention.decode_in_groups
    monkeypatch.setattr(TieredIndexedAttention, "decode_in_groups", lambda self, parts, *a: calls.append(parts) or
                        grouped(self, parts, *a))
    prompts = [_prompt(300, 1), _prompt(150, 2), _prompt(21, 3)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = []
    for groups in (1, 2):
        llm = _llm(qwen4, True, dtype="float32")
        llm.engine.runner.tier.read_groups = groups
        outs.append([(o.token_ids, o.logprobs) for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)])
    assert calls and set(calls) == {2}
    for (t1, l1), (t2, l2) in zip(*outs):
        assert t1 == t2 and max(abs(a - b) for a, b in zip(l1, l2)) < 1e-5
