"""qwen4_exp (QSA indexer, hyper-connections, PLE, MoE) against transformers' Qwen4ExpForCausalLM, fp32 CPU.

The tiny config (conftest.TINY["qwen4_exp_text"]) has a QSA budget of 32 tokens (8 blocks of 4), so
with 300-token contexts every later query really prunes, in prefill and in decode.
"""
import json
import os

import pytest
import torch

from conftest import last_logits
from sketchkv import LLM, SamplingParams
from sketchkv.errors import CheckpointError
from sketchkv.ops.qsa import SENTINEL, block_scores, select_positions

# fp32 on CPU agrees to ~1e-7 here; a wrong pick moves these logits by ~5e-3 (test_selection_matters)
ATOL, RTOL = 2e-5, 1e-4


def _prompt(n: int, seed: int, eos_at: int | None = None) -> list[int]:
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    if eos_at is not None:
        ids[eos_at] = 0  # an EOS inside the prompt resets the PLE n-gram context
    return ids


def _hf_greedy(model, ids, n):
    """n greedy tokens from transformers with its cache; EOS is an ordinary token (ours run ignore_eos)."""
    out, toks = [], torch.tensor([ids])
    with torch.no_grad():
        r = model(toks, use_cache=True)
        for _ in range(n):
            out.append(int(r.logits[0, -1].argmax()))
            r = model(torch.tensor([[out[-1]]]), cache=r.cache, use_cache=True)
    return out


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    from conftest import make_checkpoint
    path = str(tmp_path_factory.mktemp("q4") / "qwen4_exp")
    return path, make_checkpoint(path, "qwen4_exp_text")


def test_logits_and_greedy_match_transformers(qwen4):
    path, hf = qwen4
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=128)
    ids = _prompt(300, 1, eos_at=100)
    logits = last_logits(llm, ids)  # 128-token chunks: later chunks select over a cached prefix
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, ref, rtol=RTOL, atol=ATOL)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0].token_ids
    assert ours == _hf_greedy(hf, ids, 24)
    idx, counts = llm.engine.runner.qsa_layers[0].last_indices  # the last decode step really pruned
    assert int(counts.max()) <= 32 + 3 and int(counts.max()) < len(ids)


def test_batch_of_different_lengths_matches_transformers(qwen4):
    """Three sequences decoded together; 64-token chunks, so prompt chunks and decode rows share steps."""
    path, hf = qwen4
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64)
    prompts = [_prompt(150, 2), _prompt(230, 3, eos_at=7), _prompt(21, 4)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert ours == [_hf_greedy(hf, p, 16) for p in prompts]


def test_selection_matters(qwen4):
    """The budget really prunes: transformers itself moves these logits when the budget covers everything."""
    import transformers as tf
    path, hf = qwen4
    dense = tf.Qwen4ExpForCausalLM.from_pretrained(path, indexer_budget=4096).eval()
    ids = torch.tensor([_prompt(300, 1)])
    with torch.no_grad():
        assert (hf(ids).logits[0, -1] - dense(ids).logits[0, -1]).abs().max() > 50 * ATOL


def test_select_positions_matches_per_query_reference():
    """The batched selector against transformers' per-query loop (block topk + tail), random scores."""
    g = torch.Generator().manual_seed(0)
    c, topk, G = 4, 3, 9
    q, keys = torch.randn(40, 4, 8, generator=g), torch.randn(G, 8, generator=g)
    visible = torch.arange(1, 41)
    idx, counts = select_positions(block_scores(q, keys), visible, topk, c)
    for i in range(40):
        nb = int(visible[i]) // c
        want = []
        if nb:
            s = torch.relu(q[i] @ keys[:nb].T).sum(0) / 8 ** 0.5
            for b in s.topk(min(topk, nb)).indices.tolist():
                want += range(b * c, b * c + c)
        want += range(nb * c, int(visible[i]))
        assert idx[i, : counts[i]].tolist() == sorted(want)
        assert (idx[i, counts[i]:] == SENTINEL).all()


def test_ple_tables_split_across_files_load(qwen4, tmp_path):
    """n-gram table shards in different safetensors files (index json) load like one file."""
    from safetensors.torch import load_file, save_file
    path, hf = qwen4
    split = str(tmp_path / "split")
    os.makedirs(split)
    for f in os.listdir(path):
        if f != "model.safetensors":
            with open(os.path.join(path, f), "rb") as a, open(os.path.join(split, f), "wb") as b:
                b.write(a.read())
    tensors = load_file(os.path.join(path, "model.safetensors"))
    odd = {k: v for k, v in tensors.items() if k.endswith(("shard_1.weight", "shard_3.weight"))}
    rest = {k: v for k, v in tensors.items() if k not in odd}
    save_file(rest, os.path.join(split, "a.safetensors"), metadata={"format": "pt"})
    save_file(odd, os.path.join(split, "b.safetensors"), metadata={"format": "pt"})
    weight_map = {**{k: "a.safetensors" for k in rest}, **{k: "b.safetensors" for k in odd}}
    with open(os.path.join(split, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    llm = LLM(split, device="cpu", dtype="float32", block_size=16)
    ids = _prompt(60, 5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(last_logits(llm, ids), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("change,needle", [
    (dict(indexer_kv_heads=2), "indexer_kv_heads=1"),
    (dict(indexer_budget=30), "divisible by indexer_compress_ratio"),
    (dict(indexer_n_heads=None), "QSA indexer fields"),
    (dict(hc_count=1), "hc_count > 1"),
    (dict(ple_layer_ids=[2]), "linear_attention layers"),
    (dict(indexer_head_dim=4), "rotary_dim"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "indexed_attention"]),
     "layer_types"),
])
def test_bad_config_is_one_line_checkpoint_error(qwen4, tmp_path, change, needle):
    path, _ = qwen4
    bad = str(tmp_path / "bad")
    os.makedirs(bad)
    raw = json.load(open(os.path.join(path, "config.json")))
    raw.update(change)
    json.dump(raw, open(os.path.join(bad, "config.json"), "w"))
    os.symlink(os.path.join(path, "model.safetensors"), os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        LLM(bad, device="cpu", dtype="float32")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_gpu_bytes_per_token_per_qsa_layer(qwen4):
    """Block keys cost D x dtype / c per token per QSA layer, measured from the allocated buffers: 16 B
    here (D = 16, fp32, c = 4); at the real shape (D = 128, bf16, c = 4) 64 B, the seed's figure."""
    path, _ = qwen4
    llm = LLM(path, device="cpu", dtype="float32", block_size=16)
    mem = llm.engine.runner.qsa_memory()
    assert mem["index_bytes_per_token"] == 16 * 4 / 4
    assert mem["tail_state_bytes_per_seq"] == 4 * 16 * 4
    from sketchkv.models.presets import preset_config
    cfg, _ = preset_config("qwen4-exp-h200")
    assert cfg.indexer_head_dim * 2 // cfg.indexer_compress_ratio <= 66


def test_prefix_cache_hit_gives_the_same_tokens(qwen4):
    """A follow-up request sharing a prefix restores GDN + PLE state from the snapshot and reuses the
    cached K/V and block keys (the index tail is empty at block boundaries)."""
    path, _ = qwen4
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64)
    ids = _prompt(200, 6)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0]
    again = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0]
    assert again.num_cached_tokens > 0
    assert again.token_ids == first.token_ids


# ---- QSA prefill memory: sliced scoring and the gather path (sketchkv/layers/indexed_attention.py) ----

def _one_shot_block_scores(q, keys):
    """block_scores before slicing: the whole [N, H, G] einsum, then relu-sum over heads."""
    eq = "nhd,ngd->nhg" if keys.dim() == 3 else "nhd,gd->nhg"
    return torch.relu(torch.einsum(eq, q.float(), keys.float())).sum(dim=1) / q.shape[-1] ** 0.5


@pytest.mark.parametrize("N,G,shared,dtype", [(512, 3001, True, torch.float32), (37, 9000, True, torch.bfloat16),
                                              (3, 1000, False, torch.float32), (100, 700, True, torch.bfloat16)])
def test_sliced_block_scores_bitwise_equal_one_shot(N, G, shared, dtype):
    """Slices of blocks (a ragged last one too) give the one-shot scores bit for bit, hence the same picks."""
    g = torch.Generator().manual_seed(N + G)
    q = torch.randn(N, 16, 128, generator=g).to(dtype)
    keys = torch.randn(G, 128, generator=g) if shared else torch.randn(N, G, 128, generator=g)
    keys = keys.to(dtype)
    want = _one_shot_block_scores(q, keys)
    got = block_scores(q, keys, max_bytes=4 * N * 16 * 300)  # 256-block slices
    assert torch.equal(got, want)
    visible = torch.randint(1, 4 * G + 1, (N,), generator=g)
    assert torch.equal(select_positions(got, visible, 64, 4)[0], select_positions(want, visible, 64, 4)[0])


def _qsa_run(path, monkeypatch, gather: bool, tier: bool, **score):
    """Greedy tokens / log-probabilities of two prompts plus a follow-up turn (prefix-cache hit), and the
    last-position logits of a 300-token prompt prefilled in 128-token chunks: fp32, QSA budget 32."""
    from sketchkv.layers import indexed_attention as ia
    monkeypatch.setattr(ia, "GATHER_MIN_CONTEXT", 0 if gather else 10**9)
    for k, v in score.items():
        monkeypatch.setattr(ia, k, v)
    opts = dict(sparse_host_tier=True, sparse_host_format="bf16", sparse_sink_tokens=4,
                sparse_recent_tokens=8) if tier else {}
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=128, **opts)
    ids = _prompt(300, 1, eos_at=100)
    logits = last_logits(llm, ids)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompt_token_ids=[ids, _prompt(170, 2)], sampling_params=sp)
    follow = llm.generate(prompt_token_ids=[ids + _prompt(40, 3)], sampling_params=sp)[0]
    assert follow.num_cached_tokens >= 288
    return logits, [(o.token_ids, o.logprobs) for o in outs + [follow]]


@pytest.mark.parametrize("tier", [False, True])
def test_gather_prefill_matches_masked_prefill(qwen4, monkeypatch, tier):
    """Each query attending its own gathered picks == the boolean-mask path: same tokens, logits and
    log-probabilities within fp32 summation order (~1e-7 here; a wrong pick moves them ~5e-3).
    SCORE_BYTES = 4 KiB splits each 128-token step of the gather run into query chunks (11 queries at
    350 tokens). With the tier the context comes back from host rows; without it, also against
    transformers."""
    path, hf = qwen4
    ref_logits, ref = _qsa_run(path, monkeypatch, gather=False, tier=tier)
    logits, got = _qsa_run(path, monkeypatch, gather=True, tier=tier, SCORE_BYTES=4096)
    print("gather vs masked: max |logit diff|", float((logits - ref_logits).abs().max()),
          "max |logprob diff|", max(abs(x - y) for (_, a), (_, b) in zip(got, ref) for x, y in zip(a, b)))
    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
    assert [t for t, _ in got] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(got, ref):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=RTOL, atol=ATOL)
    if not tier:
        with torch.no_grad():
            want = hf(torch.tensor([_prompt(300, 1, eos_at=100)])).logits[0, -1]
        torch.testing.assert_close(logits, want, rtol=RTOL, atol=ATOL)


def _largest_prefill_temporary(path, monkeypatch, gather: bool, n_prompt: int) -> int:
    """Bytes of the largest tensor any op allocates inside QSA prefill (views and in-place ops excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from sketchkv.layers import indexed_attention as ia

    largest = [0]

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    largest[0] = max(largest[0], t.untyped_storage().nbytes())
            return out

    prefill = ia.IndexedAttention.prefill

    def tracked(self, *a, **kw):
        with Track():
            return prefill(self, *a, **kw)

    monkeypatch.setattr(ia.IndexedAttention, "prefill", tracked)
    monkeypatch.setattr(ia, "GATHER_MIN_CONTEXT", 0 if gather else 10**9)
    monkeypatch.setattr(ia, "SCORE_BYTES", 32 << 10)
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=128)
    last_logits(llm, _prompt(n_prompt, 9))
    return largest[0]


def test_gather_prefill_temporaries_do_not_grow_with_context(qwen4, monkeypatch):
    """4x the context: the gather path's largest temporary does not grow (scores stay within SCORE_BYTES
    by shrinking the query chunk, K/V are read per pick), the masked path's does (K/V repeated over the
    query group, [queries, context] mask). With SCORE_BYTES = 32 KiB the largest is a per-head slice
    [queries, 8 heads, <= 256 blocks] (the slice floor), <= 8 x SCORE_BYTES; at the real shape slices
    stay within SCORE_BYTES."""
    path, _ = qwen4
    new = [_largest_prefill_temporary(path, monkeypatch, True, n) for n in (600, 2400)]
    old = [_largest_prefill_temporary(path, monkeypatch, False, n) for n in (600, 2400)]
    print("largest prefill temporary (bytes) gather:", new, "masked:", old)
    assert new[1] <= new[0] <= 8 * (32 << 10) < old[1] and old[1] > 3 * old[0]
