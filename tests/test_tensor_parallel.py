"""Tensor parallelism on CPU (gloo, two processes): TP=2 computes what TP=1 computes.

Tolerances: fp32 everywhere; TP=2 adds each row-parallel layer's two partial sums after computing
them separately, so logits differ from TP=1 only by fp32 summation order (~1e-6 relative per
layer), far below any greedy margin on these prompts.
"""
import os

import pytest
import torch
import torch.multiprocessing as mp

from sketchkv import LLM, SamplingParams
from sketchkv.config import build_config, default_model
from sketchkv.errors import RequestError
from conftest import free_port

REF = default_model()
has_reference = pytest.mark.skipif(not os.path.isfile(os.path.join(REF, "model.safetensors")),
                                   reason="the reference model is not in sketchkv/assets")
CPU = dict(device="cpu", dtype="float32", block_size=16)


def _prompts(lengths: list[int]) -> list[list[int]]:
    from sketchkv.eval.common import heldout_token_ids
    ids = heldout_token_ids(REF, sum(lengths))  # jinja2, a dependency, is one of the held-out packages
    out, start = [], 0
    for n in lengths:
        out.append(ids[start:start + n])
        start += n
    return out


def _generate(prompts, max_tokens, **options):
    llm = LLM(REF, **CPU, **options)
    try:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
        again = [o.token_ids for o in llm.generate(prompt_token_ids=prompts[:1], sampling_params=sp)]  # prefix hit
        logprobs = llm.teacher_force(prompts[:1], [outs[0]])[0]
        return outs + again, logprobs
    finally:
        llm.shutdown()


@has_reference
def test_tp2_greedy_tokens_and_logits_equal_tp1_on_reference_model():
    """Several sequences of different lengths in one batch, prompts chunked over steps (mixed
    prefill + decode steps), then a prefix-cache hit that restores each rank's GDN snapshot."""
    prompts = _prompts([300, 45, 170, 9])
    opts = dict(max_num_batched_tokens=128, snapshot_interval_blocks=4)
    ref, ref_lp = _generate(prompts, 24, **opts)
    got, got_lp = _generate(prompts, 24, tensor_parallel_size=2, **opts)
    assert got == ref
    torch.testing.assert_close(got_lp, ref_lp, rtol=1e-4, atol=1e-4)


@has_reference
@pytest.mark.parametrize("combine,shared", [("softmax", True), ("sum", True), ("max", True), ("softmax", False)])
def test_tp2_sparse_decode_picks_equal_tp1(combine, shared):
    """Sparse decode with a tiny top-k, so selection really drops tokens: each rank scores its own KV
    heads; a shared pick all-reduces the combined scores first, so the picks (and tokens) equal TP=1's."""
    from sketchkv.config import SparseConfig
    sp = SparseConfig(sparse=True, top_k=16, sink_tokens=4, recent_tokens=16, dense_threshold=48,
                      head_combine=combine, shared_selection=shared)
    prompts = _prompts([260, 120])
    picks = {}
    for tp in (1, 2):
        llm = LLM(REF, **CPU, sparse=sp, tensor_parallel_size=tp)
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            out = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
            idx, counts = llm.engine.runner.sparse_layers[-1].last_indices
            picks[tp] = out, idx, counts
        finally:
            llm.shutdown()
    (ref, ref_idx, _), (got, idx, counts) = picks[1], picks[2]
    assert counts.max().item() == 4 + 16 + 16 < 120  # selection happened
    assert got == ref
    if shared:  # per-KV-head picks: rank 0 holds the first half of the heads
        assert torch.equal(idx, ref_idx)
    else:
        assert torch.equal(idx, ref_idx[:, :idx.shape[1]])


# ---- the sharding transform alone (two ranks spawned here, no engine) -------------------------------
def _runner_logits(model: str, tp: int, seqs_ids: list[list[int]]):
    from sketchkv.engine.model_runner import ModelRunner
    from sketchkv.engine.sequence import Sequence
    from sketchkv.models.loader import load_model
    cpu = torch.device("cpu")
    cfg = build_config(model=model, **CPU, tensor_parallel_size=tp, max_model_len=256, max_num_seqs=4)
    model_cfg, m = load_model(model, torch.float32, cpu)
    runner = ModelRunner(cfg, model_cfg, m, cpu, torch.float32)
    batch, block = [], 1
    for slot, ids in enumerate(seqs_ids):
        seq = Sequence(ids, params=None)
        n_blocks = (len(ids) + 15) // 16
        seq.block_table, seq.state_slot = list(range(block, block + n_blocks)), slot
        block += n_blocks
        batch.append((seq, len(ids)))
    return runner.logits_for(batch), runner.model_cfg, runner.model


def _rank(rank: int, port: int, model: str, seqs_ids, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logits, model_cfg, model_ = _runner_logits(model, 2, seqs_ids)
        gdn = next((m for m in model_.modules() if hasattr(m, "num_v_heads")), None)
        shapes = dict(heads=model_cfg.num_heads, kv_heads=model_cfg.num_kv_heads,
                      gdn=(gdn.num_k_heads, gdn.num_v_heads, tuple(gdn.conv1d.weight.shape)) if gdn else None,
                      vocab_rows=model_.lm_head.weight.shape[0])
        torch.save((logits, shapes), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model", ["random:tiny-hybrid", "llama-bias"])
def test_sharded_forward_equals_unsharded(model, tiny_checkpoint, tmp_path):
    """One prefill forward of three sequences, shard_model on two gloo ranks vs the whole model.
    tiny-hybrid: 4 value heads over 2 key heads (the GDN grouping survives the cut); llama with
    biases: a row-parallel bias is added once."""
    if model == "llama-bias":
        model, _ = tiny_checkpoint("llama", attention_bias=True, mlp_bias=True)
    seqs = [list(range(3, 40)), list(range(50, 57)), list(range(7, 70, 2))]
    ref, _, _ = _runner_logits(model, 1, seqs)
    out = str(tmp_path / "logits")
    mp.spawn(_rank, args=(free_port(), model, seqs, out), nprocs=2)
    (got0, shapes), (got1, _) = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    torch.testing.assert_close(got0, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got1, got0)  # every rank gets the full-vocab logits
    assert shapes["heads"] == 2 and shapes["kv_heads"] == 1
    if shapes["gdn"]:  # tiny-hybrid: key heads 2 -> 1, value heads 4 -> 2, conv rows 2*32 + 2*32 + ... halved
        assert shapes["gdn"] == (1, 2, (2 * 32 + 2 * 32, 1, 4))


@pytest.fixture(scope="module")
def int4_reference(tmp_path_factory):
    """The reference model quantized by `sketchkv quantize` (RTN, asymmetric: zero points differ per group and column,
    so a wrongly cut zeros tensor shows; group 32: each rank's share of the row-parallel inputs, 128 / 128 / 384 rows,
    is several whole groups)."""
    from sketchkv.cli import main
    dst = str(tmp_path_factory.mktemp("tp-int4") / "w4a16")
    assert main(["quantize", REF, dst, "--kl-samples", "0", "--group-size", "32", "--asym"]) == 0
    return dst


@has_reference
def test_tp2_int4_greedy_tokens_and_logits_equal_tp1(int4_reference):
    """W4A16 weights cut by rank (canonical words unshuffled, columns / whole groups of rows sliced, fused and prepared
    again): TP=2 decodes what TP=1 decodes from the same int4 checkpoint."""
    prompts = _prompts([120, 33, 64])

    def run(**options):
        llm = LLM(int4_reference, **CPU, max_num_batched_tokens=64, **options)
        try:
            assert any(type(m).__name__ == "Int4Linear" for m in llm.engine.runner.model.modules())
            sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            outs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
            return outs, llm.teacher_force(prompts[:1], [outs[0]])[0]
        finally:
            llm.shutdown()

    ref, ref_lp = run()
    got, got_lp = run(tensor_parallel_size=2)
    assert got == ref
    torch.testing.assert_close(got_lp, ref_lp, rtol=1e-4, atol=1e-4)


@has_reference
def test_tp_int4_groups_split_by_ranks_fail_in_one_line(int4_reference, tmp_path):
    import json
    import shutil
    dst = tmp_path / "g256"
    shutil.copytree(int4_reference, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 256     # o_proj's 256 input rows: 128 per rank at TP=2
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RequestError, match="not whole int4 groups of 256"):
        LLM(str(dst), device="cpu", tensor_parallel_size=2)


def test_indivisible_heads_and_unsupported_combos_fail_in_one_line():
    with pytest.raises(RequestError, match="tensor_parallel_size=3 must divide the model's num_attention_heads=4"):
        LLM("random:tiny-hybrid", device="cpu", tensor_parallel_size=3)
    with pytest.raises(RequestError, match="qwen4_exp"):
        LLM("random:tiny-qwen4-exp", device="cpu", tensor_parallel_size=2)
    with pytest.raises(RequestError, match="host_tier"):
        LLM("random:tiny-hybrid", device="cpu", tensor_parallel_size=2, sparse_host_tier=True, sparse=True)
    with pytest.raises(RequestError, match="speculative"):
        LLM("random:tiny-hybrid", device="cpu", tensor_parallel_size=2, num_speculative_tokens=2)


def test_a_dead_worker_ends_the_process_with_a_message_instead_of_a_hang(tmp_path):
    """A worker that dies mid-run would leave rank 0 in a collective forever on NCCL (seen on 2 x H200):
    rank 0 names the dead rank and exits."""
    import subprocess
    import sys
    script = tmp_path / "kill_worker.py"
    script.write_text(
        "import os, signal, time\n"
        "from sketchkv import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM('random:tiny-hybrid', device='cpu', tensor_parallel_size=2)\n"
        "    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
        "    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp)\n"
        "    os.kill(llm.engine.runner.workers.procs[0].pid, signal.SIGKILL)\n"
        "    for _ in range(600):\n"
        "        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp)\n"
        "        time.sleep(0.1)\n"
        "    print('still running')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "tensor-parallel worker sketchkv-tp1 (exit code -9) died" in r.stderr, r.stderr[-3000:]
    assert "still running" not in r.stdout
