"""Our models against transformers' implementations on tiny random configs (fp32, CPU)."""
import pytest
import torch

from sketchkv import LLM, SamplingParams

CASES = [
    ("qwen3_5_text", {}),
    ("qwen3_5_text", dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1,  # GQA 2, rotary 0.5
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                          layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    ("qwen3_5_text", dict(linear_num_value_heads=2, linear_value_head_dim=32, tie_word_embeddings=True)),
    ("qwen3_next", {}),
    ("qwen3", {}),
    ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    ("llama", {}),
    ("llama", dict(num_key_value_heads=1, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 256})),
]


def _hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("model_type,overrides", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_logits_and_greedy_match_transformers(tiny_checkpoint, model_type, overrides):
    path, hf = tiny_checkpoint(model_type, **overrides)
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=128)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (320,), generator=g).tolist()
    # Final-position logits of a >= 300-token prompt, computed through chunked prefill (128-token chunks).
    runner, eng = llm.engine.runner, llm.engine
    seq = eng.add_request(ids, SamplingParams(max_tokens=1))
    batch = eng.scheduler.schedule()
    logits = None
    while batch:
        logits = runner.run(batch, sample_now=False)
        eng.scheduler.after_step(batch)
        batch = eng.scheduler.schedule() if seq.num_uncached else []
    eng.scheduler.finish(seq)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[-1], ref, rtol=1e-4, atol=1e-4)
    # 32 greedy tokens identical (prefill + decode path).
    ours = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=32,
                                                                               ignore_eos=True))[0].token_ids
    assert ours == _hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3"])
def test_batched_decode_matches_single(tiny_checkpoint, model_type):
    path, _ = tiny_checkpoint(model_type)
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 77, 140, 33)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids for p in prompts]
    assert together == alone


def test_moe_static_routing_matches_the_expert_loop():
    """The decode path (every expert over every token, weighted by the routing; CUDA-graph capturable)
    gives the prefill path's result (a loop over the experts that got tokens)."""
    from sketchkv.layers.mlp import SparseMoE
    torch.manual_seed(0)
    moe = SparseMoE(hidden=48, moe_intermediate=32, num_experts=16, top_k=4, norm_topk_prob=True, shared_intermediate=24)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(9, 48)
    probs = torch.softmax(moe.gate(x).float(), -1)
    w, e = torch.topk(probs, 4, -1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    torch.testing.assert_close(moe._all_experts(x, w, e), moe._experts_with_tokens(x, w, e), rtol=1e-5, atol=1e-6)
    assert moe(x).shape == x.shape and x.shape[0] <= moe.STATIC_MAX_TOKENS
