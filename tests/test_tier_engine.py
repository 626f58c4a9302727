"""The host tier inside the engine: sparse decode reading sinks / tail / hot rows / host misses.

CPU runs are the spec (the tier lives in ordinary memory there); GPU tests carry the `gpu` marker
(pinned memory, zero-copy misses, CUDA graphs). The tiny checkpoint is fp32 on the CPU, so bf16
host rows round the picked K/V: tokens must match tier-off, log-probabilities within bf16 noise.
"""
import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.errors import CapacityError
from sketchkv.kv.host_store import HostKVStore
from sketchkv.layers.tiered_attention import TieredAttention
from sketchkv.ops import paged_attention as pa
from conftest import run_interpreter_tests

needs_interp = pytest.mark.skipif(not pa._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
SPARSE = dict(sparse=True, sparse_top_k=16, sparse_sink_tokens=4, sparse_recent_tokens=8, sparse_dense_threshold=0)


def _prompt(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, tier: bool, fmt="bf16", **kw):
    opts = dict(device="cpu", block_size=16, max_num_seqs=4, **SPARSE)
    if tier:
        opts.update(sparse_host_tier=True, sparse_host_format=fmt)
    return LLM(path, **{**opts, **kw})


def _gpu_budget(tier, pool_rows: int) -> float:
    """GiB for the tier's fixed GPU part (as sized by the runner) plus pool_rows hot rows."""
    return (tier.gpu_bytes - tier.hot.P * tier.hot.row_bytes + pool_rows * tier.hot.row_bytes) / 2**30


def test_tier_bf16_same_tokens_as_tier_off(ckpt_with_basis):
    """Chunked prefill (prefix read back from the tier), mixed steps and sparse decode with misses
    and hits: the same greedy tokens as without the tier."""
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    prompts = [_prompt(300, 1), _prompt(90, 2), _prompt(170, 3)]
    for kw in ({}, {"max_num_batched_tokens": 64}):
        off = _llm(ckpt_with_basis, False, **kw).generate(prompt_token_ids=prompts, sampling_params=sp)
        llm = _llm(ckpt_with_basis, True, **kw)
        on = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        for a, b in zip(off, on):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 3e-2  # bf16 rows, fp32 model
        s = llm.tier_stats()
        assert s.hits > 0 and s.misses > 0 and s.pcie_read_bytes > 0


def test_tier_topk_ge_context_equals_dense(ckpt_with_basis):
    """top_k >= context: every token is read (sinks + tail resident, the rest via hot buffer / host)."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [_prompt(200, 4), _prompt(60, 5)]
    dense = LLM(ckpt_with_basis, device="cpu", block_size=16).generate(prompt_token_ids=prompts, sampling_params=sp)
    llm = _llm(ckpt_with_basis, True, sparse_top_k=4096)
    on = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    for d, t in zip(dense, on):
        assert d.token_ids == t.token_ids
        assert max(abs(a - b) for a, b in zip(d.logprobs, t.logprobs)) < 5e-3
    _, counts = llm.engine.runner.tier_layers[0].last_indices
    assert counts.tolist() == [200 + 11, 60 + 11]


def test_tier_gpu_kv_cache_shrinks(ckpt_with_basis):
    """With the tier the full-attention layers hold no paged K/V on the device: only sketches."""
    off, on = _llm(ckpt_with_basis, False).engine.runner, _llm(ckpt_with_basis, True).engine.runner
    assert on.tier_layers and all(isinstance(m, TieredAttention) for m in on.attn_layers)
    assert all(m.k_cache.numel() == 0 and m.v_cache.numel() == 0 for m in on.tier_layers)
    assert on.kv_bytes_per_block < off.kv_bytes_per_block / 4
    c = on.model_cfg
    assert on.tier.store.row_bytes == c.num_kv_heads * 4 * c.head_dim  # bf16 K + V


@pytest.mark.parametrize("fmt,min_agree", [("int8", 0.95), ("int4", 0.8)])
def test_tier_quantized_top1_agreement(ckpt_with_basis, fmt, min_agree):
    """Teacher-forced continuations: the argmax with int4 / int8 host rows agrees with tier-off."""
    prompts = [_prompt(400, 6), _prompt(250, 7)]
    conts = [_prompt(40, 8), _prompt(40, 9)]
    ref = _llm(ckpt_with_basis, False).teacher_force(prompts, conts)
    got = _llm(ckpt_with_basis, True, fmt).teacher_force(prompts, conts)
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    assert agree >= min_agree, (agree, kl)
    assert kl < 0.05


def test_tier_follow_up_turn_reuses_prefix(ckpt_with_basis):
    """A follow-up request whose prefix sits in the tier: its sinks / recent rows come from the host
    rows (no bulk copy) and it decodes as tier-off does."""
    first = _prompt(300, 10)
    follow = first + _prompt(40, 11)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for tier in (False, True):
        llm = _llm(ckpt_with_basis, tier)
        llm.generate(prompt_token_ids=[first], sampling_params=sp)
        out = llm.generate(prompt_token_ids=[follow], sampling_params=sp)[0]
        assert out.num_cached_tokens >= 256
        outs.append(out.token_ids)
    assert outs[0] == outs[1]


def test_tier_refuses_over_budget_others_unaffected(ckpt_with_basis):
    """Host budget of ~40 blocks and a GPU budget for ~2 small partitions: a request that can never
    fit is refused at once with one clear line; the requests in flight finish as they would alone."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    small = [_prompt(120, 12), _prompt(100, 13)]
    alone = _llm(ckpt_with_basis, True).generate(prompt_token_ids=small, sampling_params=sp)
    probe = _llm(ckpt_with_basis, True).engine.runner.tier
    host = 40 * probe.store.bytes_per_block / 2**30
    eng = _llm(ckpt_with_basis, True, sparse_host_budget_gb=host).engine
    seqs = [eng.add_request(p, sp) for p in small]
    eng.step()
    with pytest.raises(CapacityError, match=r"host KV .* sparse_host_budget_gb") as e:
        eng.add_request(_prompt(700, 14), sp)
    assert "\n" not in str(e.value)
    while eng.has_unfinished:
        eng.step()
    assert [s.output_token_ids for s in seqs] == [a.token_ids for a in alone]
    # GPU: the fixed part plus 150 hot rows; a 7000-token prompt needs 175 rows (2.5%)
    eng = _llm(ckpt_with_basis, True, sparse_gpu_budget_gb=_gpu_budget(probe, 150)).engine
    assert 150 <= eng.runner.tier.hot.P < 175
    with pytest.raises(CapacityError, match="hot-buffer rows .* sparse_gpu_budget_gb"):
        eng.add_request(_prompt(7000, 15), sp)


def test_tier_waits_for_hot_rows(ckpt_with_basis):
    """A pool with room for one sequence's partition at a time: the second waits in the queue and
    both finish with their own tokens."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [_prompt(150, 16), _prompt(130, 17)]
    alone = [_llm(ckpt_with_basis, True).generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids
             for p in prompts]
    probe = _llm(ckpt_with_basis, True).engine.runner.tier
    llm = _llm(ckpt_with_basis, True, sparse_gpu_budget_gb=_gpu_budget(probe, 100))
    assert 64 <= llm.engine.runner.tier.hot.P < 128  # one partition of 64 rows at a time
    eng = llm.engine
    seqs = [eng.add_request(p, sp) for p in prompts]
    eng.step()
    assert seqs[0].tier_pid >= 0 and seqs[1].tier_pid < 0 and seqs[1] in eng.scheduler.waiting
    while eng.has_unfinished:
        eng.step()
    assert [s.output_token_ids for s in seqs] == alone


def test_tier_stats_add_up(ckpt_with_basis):
    """hits + misses = picks looked up; PCIe reads = (misses + prefix rows read back) x row bytes;
    PCIe writes = tokens forwarded x layers x row bytes; per-sequence host bytes = blocks x block bytes."""
    prompts = [_prompt(300, 18), _prompt(90, 19)]
    n_out = 10
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    llm = _llm(ckpt_with_basis, True, fmt="int4")
    eng, tier = llm.engine, llm.engine.runner.tier
    picks = prefix_rows = 0
    orig_gather, orig_prefix = tier.gather, tier.read_prefix

    def gather(layer, pos, counts, block_tables, seq_lens, state_slots):
        nonlocal picks
        n = seq_lens.long()[:, None]
        p = pos.long()
        ok = torch.arange(p.shape[1])[None] < counts.long()[:, None]
        picks += int((ok & (p >= 4) & (p < torch.clamp(n - 8, min=4))).sum())
        return orig_gather(layer, pos, counts, block_tables, seq_lens, state_slots)

    def read_prefix(layer, block_table, n, dtype):
        nonlocal prefix_rows
        prefix_rows += n
        return orig_prefix(layer, block_table, n, dtype)
    tier.gather, tier.read_prefix = gather, read_prefix
    for p in prompts:
        eng.add_request(p, sp)
    seen = {}
    while eng.has_unfinished:
        eng.step()
        for rid, st in llm.tier_stats(per_sequence=True).items():
            seen[rid] = st
    s = llm.tier_stats()
    L, rb = tier.L, tier.store.row_bytes
    assert s.hits + s.misses == picks > 0
    assert s.pcie_read_bytes == (s.misses + prefix_rows) * rb
    forwarded = sum(len(p) + n_out - 1 for p in prompts)
    assert s.pcie_write_bytes == forwarded * L * rb
    assert 0 < s.hit_rate < 1 and s.host_bytes == tier.store.total_bytes and s.gpu_bytes == tier.gpu_bytes
    for st, p in zip(seen.values(), prompts):
        blocks = -(-(len(p) + n_out - 1) // 16)
        assert st.host_bytes == blocks * tier.store.bytes_per_block
        assert st.gpu_bytes > 0
    assert HostKVStore.bytes_per_token(L, tier.Hkv, tier.D, "int4") * 16 == tier.store.bytes_per_block


def test_tier_config_errors(ckpt_with_basis):
    from sketchkv.errors import RequestError
    with pytest.raises(RequestError, match="needs sparse decode"):
        LLM(ckpt_with_basis, device="cpu", sparse_host_tier=True)
    with pytest.raises(RequestError, match="shared_selection"):
        _llm(ckpt_with_basis, True, sparse_shared_selection=False)
    with pytest.raises(CapacityError, match="holds no KV block"):
        _llm(ckpt_with_basis, True, sparse_host_budget_gb=1e-9)
    with pytest.raises(CapacityError, match="below the host tier's fixed part"):
        _llm(ckpt_with_basis, True, sparse_gpu_budget_gb=1e-9)


# ---- kernels of one tiered step under the interpreter ----------------------------------------------

@needs_interp
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_interp_tier_step_matches_reference(fmt):
    """HostTier.gather (zero-copy gather kernel for misses) + the paged decode kernel over the compact
    scratch equals exact attention over the same rows dequantised by the reference."""
    from sketchkv.kv.host_tier import ATTN_BLOCK, HostTier
    from sketchkv.ops.sparse_attention import sparse_attention_ref
    torch.manual_seed(0)
    Hq, Hkv, D, bs, S, R = 4, 2, 32, 16, 4, 8
    tier = HostTier(1, 12, bs, Hkv, D, fmt=fmt, sinks=S, recent=R, hot_fraction=0.1, num_state_slots=3,
                    max_model_len=160, pool_rows=64, dtype=torch.float32, device=torch.device("cpu"))
    lens = [70, 37]
    tables = torch.tensor([[3, 5, 1, 7, 9], [2, 4, 6, -1, -1]], dtype=torch.int32)
    k = torch.randn(2, 80, Hkv, D)
    v = torch.randn(2, 80, Hkv, D)
    for b, n in enumerate(lens):
        pos = list(range(n))
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in pos])
        rows = torch.tensor([tier.resident_row(b, p, n) for p in pos])
        tier.write(0, slots, rows, k[b, :n], v[b, :n])
    pids = [tier.hot.add_sequence(rows=16) for _ in lens]
    # selections: sinks + a few picks + tail, ascending, SENTINEL-padded; counts per sequence
    sel = [sorted(set(range(S)) | {9, 20, 33, 41, 50} | set(range(62, 70))), sorted(set(range(S)) | {5, 17, 25} | set(range(29, 37)))]
    N = max(len(x) for x in sel) + 3
    idx = torch.full((2, N), 2**31 - 1, dtype=torch.int32)
    for b, x in enumerate(sel):
        idx[b, :len(x)] = torch.tensor(x, dtype=torch.int32)
    counts = torch.tensor([len(x) for x in sel], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, Hq, D)
    for step in range(2):  # second step: the picks are hot
        kk, vv, miss = tier.gather(0, idx, counts, tables, seq_lens, torch.tensor([0, 1]))
        B, Np = miss.shape
        nb = Np // ATTN_BLOCK
        t = (torch.arange(B, dtype=torch.int32)[:, None] * nb + torch.arange(nb, dtype=torch.int32)[None])
        out = pa.paged_attention_decode(q, kk.view(B * nb, ATTN_BLOCK, Hkv, D), vv.view(B * nb, ATTN_BLOCK, Hkv, D),
                                        t, counts, D ** -0.5)
        placed = tier.hot.admit(0, pids, miss, kk, vv)
        assert (miss >= 0).sum() == (5 + 3 if step == 0 else 0)
        assert (placed >= 0).sum() == (miss >= 0).sum()
        # reference: a dense cache whose picked rows went through the host format, sinks/tail exact
        kc, vc = k.clone(), v.clone()
        for b, x in enumerate(sel):
            for p in x:
                if S <= p < lens[b] - R:
                    hk, hv = tier.store.read_rows_ref(0, torch.tensor([int(tables[b, p // bs]) * bs + p % bs]))
                    kc[b, p], vc[b, p] = hk[0], hv[0]
        ref = sparse_attention_ref(q, kc.view(2 * 5, bs, Hkv, D), vc.view(2 * 5, bs, Hkv, D),
                                   torch.arange(10, dtype=torch.int32).view(2, 5), idx[:, None], counts, D ** -0.5)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_interpreter_child():
    run_interpreter_tests(__file__, pa._INTERPRETED)


# ---- GPU (H200) ---------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_gpu_tier_graphs_match_tier_off():
    """random:tiny-hybrid (bf16, random basis) with CUDA graphs: tier on (bf16 rows, pinned, zero-copy
    misses) gives tier-off's greedy tokens; int4 agrees on most; the decode step never syncs the host."""
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6000, 3000, 900)]
    opts = dict(device="cuda", max_num_seqs=4, max_model_len=8192, max_num_batched_tokens=2048, sparse=True,
                sparse_top_k=256, sparse_sink_tokens=64, sparse_recent_tokens=128, sparse_dense_threshold=0)
    off = LLM("random:tiny-hybrid", **opts).generate(prompt_token_ids=prompts, sampling_params=sp)
    llm = LLM("random:tiny-hybrid", sparse_host_tier=True, sparse_host_format="bf16", **opts)
    r = llm.engine.runner
    assert r.graphs and r.tier.store.buf.is_pinned()
    on = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    for a, b in zip(off, on):
        agree = sum(x == y for x, y in zip(a.token_ids, b.token_ids)) / len(a.token_ids)
        assert agree >= 0.9, agree  # bf16 model: identical picks and rows; sums may round differently
    s = llm.tier_stats()
    assert s.hits > 0 and s.misses > 0 and s.pcie_read_bytes >= s.misses * r.tier.store.row_bytes
    on4 = LLM("random:tiny-hybrid", sparse_host_tier=True, sparse_host_format="int4", **opts).generate(
        prompt_token_ids=prompts, sampling_params=sp)
    agree = sum(x == y for a, b in zip(off, on4) for x, y in zip(a.token_ids, b.token_ids)) / (48 * 3)
    assert agree >= 0.5, agree


@pytest.mark.gpu
@needs_cuda
def test_gpu_tier_decode_step_no_host_sync():
    """One eager tiered decode step (select, gather, attention, admit) runs with sync debug = error."""
    llm = LLM("random:tiny-hybrid", device="cuda", enforce_eager=True, max_num_seqs=2, max_model_len=8192,
              sparse=True, sparse_top_k=256, sparse_sink_tokens=64, sparse_recent_tokens=128,
              sparse_dense_threshold=0, sparse_host_tier=True)
    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    eng.add_request(torch.randint(3, 1000, (5000,), generator=g).tolist(),
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while not eng.scheduler.running:
        eng.step()
    eng.step()
    from sketchkv.engine.context import set_context
    batch = eng.scheduler.schedule()
    r = eng.runner
    r._zero_fresh_slots(batch)
    ids, pos, ctx = r._context(batch)  # host -> device copies happen here, before the forward
    torch.cuda.synchronize()
    set_context(ctx)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            r.model(ids, pos)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        set_context(None)
    torch.cuda.synchronize()


def test_tier_metrics_and_flags(ckpt_with_basis):
    """The server's Prometheus metrics carry the tier's counters; the knobs map onto flat CLI flags."""
    import argparse
    import re
    from sketchkv.config import add_dataclass_args, build_config
    from sketchkv.server.metrics import ServerMetrics
    p = argparse.ArgumentParser()
    add_dataclass_args(p)
    args = p.parse_args(["--sparse", "--sparse-host-tier", "--sparse-host-format", "int8",
                         "--sparse-hot-fraction", "0.05", "--sparse-host-budget-gb", "2", "--sparse-gpu-budget-gb", "none"])
    cfg = build_config(args).sparse
    assert (cfg.host_tier, cfg.host_format, cfg.hot_fraction, cfg.host_budget_gb, cfg.gpu_budget_gb) == \
        (True, "int8", 0.05, 2.0, None)
    llm = _llm(ckpt_with_basis, True)
    eng, m = llm.engine, ServerMetrics()
    eng.add_request(_prompt(200, 20), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while eng.has_unfinished:
        eng.step()
        m.update_from_engine(eng)
    text = m.render().decode()
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    s = llm.tier_stats()
    assert value("sketchkv_tier_hits_total") == s.hits and value("sketchkv_tier_misses_total") == s.misses > 0
    assert value("sketchkv_tier_pcie_read_bytes_total") == s.pcie_read_bytes
    assert value("sketchkv_tier_pcie_write_bytes_total") == s.pcie_write_bytes
    assert value("sketchkv_tier_gpu_bytes") == s.gpu_bytes and value("sketchkv_tier_host_bytes") == s.host_bytes
    assert value("sketchkv_tier_host_bytes_used") == 0  # finished: nothing held
