"""qwen4_exp (QSA indexer, hyper-connections, PLE, MoE) against transformers' Qwen4ExpForCausalLM, fp32 CPU.

The tiny config (conftest.TINY["qwen4_exp_text"]) has a QSA budget of 32 tokens (8 blocks of 4), so
with 300-token contexts every later query really prunes, in prefill and in decode.
"""
import json
import os

import pytest
import torch

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


def _chunked_prefill_logits(llm, ids):
    eng, runner = llm.engine, llm.engine.runner
    seq = eng.add_request(ids, SamplingParams(max_tokens=1))
    batch, logits = eng.scheduler.schedule(), None
    while batch:
        logits = runner.run(batch, sample_now=False)
        eng.scheduler.after_step(batch)
        batch = eng.scheduler.schedule() if seq.num_uncached else []
    eng.scheduler.finish(seq)
    return logits[-1]


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    from conftest import make_checkpoint
    path = str(tmp_path_factory.mktemp("q4") / "qwen4_exp")
    return path, make_checkpoint(path, "qwen4_exp_text")


def test_logits_and_greedy_match_transformers(qwen4):
    path, hf = qwen4
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=128)
    ids = _prompt(300, 1, eos_at=100)
    logits = _chunked_prefill_logits(llm, ids)  # 128-token chunks: later chunks select over a cached prefix
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
    torch.testing.assert_close(_chunked_prefill_logits(llm, ids), ref, rtol=RTOL, atol=ATOL)


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
