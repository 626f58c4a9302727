"""The host tier inside the engine: sparse decode reading sinks / tail / hot rows / host misses.

CPU runs are the spec (the tier lives in ordinary memory there); GPU tests carry the `gpu` marker
(pinned memory, zero-copy misses, CUDA graphs). The tiny checkpoint is fp32 on the CPU, so bf16
host rows round the picked K/V: tokens must match tier-off, log-probabilities within bf16 noise.
"""
import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.errors import CapacityError
from sketchkv.kv import host_tier
from sketchkv.kv.host_store import HostKVStore
from sketchkv.layers import tiered_attention
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


@pytest.mark.parametrize("residual,fold", [(False, False), (True, False), (True, True)])
def test_tier_bf16_same_tokens_as_tier_off(ckpt_with_basis, residual, fold, monkeypatch):
    """Chunked prefill (prefix read back from the tier, or only one selection's rows), mixed steps and sparse
    decode with misses and hits: the same greedy tokens as without the tier. residual: the host K rows hold each
    key minus its sketch's part, added back on every read (sparse_host_residual_keys); fold: in decode, inside the
    attention's scores (tiered_attention.KEY_BASE_IN_ATTENTION)."""
    monkeypatch.setattr(tiered_attention, "KEY_BASE_IN_ATTENTION", fold)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    prompts = [_prompt(300, 1), _prompt(90, 2), _prompt(170, 3)]
    for kw in ({"sparse_prefill_selection": "dense"}, {"max_num_batched_tokens": 64, "sparse_prefill_selection": "dense"},
               {"max_num_batched_tokens": 64, "sparse_prefill_selection": "chunk"}):
        off = _llm(ckpt_with_basis, False, **kw).generate(prompt_token_ids=prompts, sampling_params=sp)
        llm = _llm(ckpt_with_basis, True, sparse_host_residual_keys=residual, **kw)
        on = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        for a, b in zip(off, on):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 3e-2  # bf16 rows, fp32 model
        s = llm.tier_stats()
        assert s.hits > 0 and s.misses > 0 and s.pcie_read_bytes > 0


def test_tier_bf16_rows_bf16_model_bit_exact(tmp_path):
    """A bf16 model (qwen3, basis fitted in bf16) with bf16 host rows: the tier reads back exactly the
    values tier-off keeps on the device, so tokens and log-probabilities are identical, through
    chunked prefill (dense or one selection per chunk), mixed steps, sparse decode and a follow-up turn from the
    prefix cache."""
    from conftest import make_checkpoint
    from sketchkv.kv.fit_basis import fit_basis
    path = str(tmp_path / "qwen3")
    make_checkpoint(path, "qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    num_hidden_layers=3, max_position_embeddings=8192)
    calib = str(tmp_path / "calib.txt")
    g = torch.Generator().manual_seed(5)
    with open(calib, "w") as f:
        f.write("".join(chr(c) for c in torch.randint(32, 127, (6000,), generator=g).tolist()))
    fit_basis(LLM(path, device="cpu", dtype="bfloat16", block_size=16), [calib], rank=8, max_tokens=3000,
              seq_len=1024, out=str(tmp_path / "qwen3" / "key_basis.safetensors"))
    first, other = _prompt(300, 21), _prompt(120, 22)
    follow = first + _prompt(50, 23)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    for sel in ("dense", "chunk"):   # prompt chunks over the whole prefix, or over one selection's rows
        outs = []
        for tier in (False, True):
            llm = _llm(path, tier, dtype="bfloat16", max_num_batched_tokens=96, sparse_prefill_selection=sel)
            a = llm.generate(prompt_token_ids=[first, other], sampling_params=sp)
            b = llm.generate(prompt_token_ids=[follow], sampling_params=sp)[0]
            assert b.num_cached_tokens >= 256
            outs.append([(o.token_ids, o.logprobs) for o in a + [b]])
        assert outs[0] == outs[1], sel


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


def test_tier_decode_in_groups_same_tokens(ckpt_with_basis, monkeypatch):
    """sparse_read_groups: a decode step's sequences in groups (on CUDA each group's reads overlap the next group's
    scoring; here the same calls in order): the same tokens, log-probabilities, picks and hot-buffer hits and
    misses as one group, and the grouped path really ran (3 sequences in 2 groups); also with each group's compose
    before its reads on the current stream (host_tier.COMPOSE_ON_READ_STREAM False) and with the residual keys' base
    inside the attention's scores (tiered_attention.KEY_BASE_IN_ATTENTION)."""
    calls = []
    grouped = TieredAttention.decode_in_groups
    monkeypatch.setattr(TieredAttention, "decode_in_groups", lambda self, parts, *a: calls.append(parts) or
                        grouped(self, parts, *a))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = [_prompt(300, 11), _prompt(90, 12), _prompt(170, 13)]
    out = {}
    for groups, compose_read, fold in ((1, True, False), (2, True, False), (2, False, False), (2, False, True)):
        monkeypatch.setattr(host_tier, "COMPOSE_ON_READ_STREAM", compose_read)
        monkeypatch.setattr(tiered_attention, "KEY_BASE_IN_ATTENTION", fold)
        llm = _llm(ckpt_with_basis, True, fmt="int4")
        assert llm.engine.runner.tier.key_base is not None   # int4 rows: residual keys
        llm.engine.runner.tier.read_groups = groups   # the runner keeps 1 on CPU (no second stream to overlap)
        res = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        s = llm.tier_stats()
        out[groups, compose_read, fold] = ([o.token_ids for o in res], [o.logprobs for o in res], s.hits, s.misses,
                                           llm.engine.runner.tier_layers[0].last_indices[1].tolist())
        assert s.hits > 0 and s.misses > 0
    assert calls and set(calls) == {2}
    one = out[1, True, False]
    for key, got in out.items():
        assert got[0] == one[0] and got[2:] == one[2:], key
        for a, b in zip(one[1], got[1]):   # the fold's keys stay fp32 (no bf16 scratch here: an fp32 model)
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, key


@pytest.mark.parametrize("fmt", ["int4", "k8v4"])
def test_tier_miss_read_rows_same_tokens(ckpt_with_basis, fmt, monkeypatch):
    """sparse_miss_read="rows" (each miss row copied whole, then dequantised from the copy) against "fields": the
    same tokens, log-probabilities, hot-buffer hits and misses (the admitted records are the same bytes); residual
    keys on with int4 (their base is added after either read); the copy path really ran."""
    from sketchkv.kv import host_store
    copies = []
    copy = host_store.HostKVStore.copy_rows
    monkeypatch.setattr(host_store.HostKVStore, "copy_rows", lambda self, *a, **k: copies.append(1) or copy(self, *a, **k))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [_prompt(300, 21), _prompt(120, 22)]
    out = {}
    for read in ("fields", "rows"):
        llm = _llm(ckpt_with_basis, True, fmt=fmt, sparse_miss_read=read)
        res = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        s = llm.tier_stats()
        out[read] = ([o.token_ids for o in res], [o.logprobs for o in res], s.hits, s.misses)
        assert s.misses > 0
    assert copies
    assert out["fields"][0] == out["rows"][0] and out["fields"][2:] == out["rows"][2:]
    for a, b in zip(out["fields"][1], out["rows"][1]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-6
    with pytest.raises(Exception, match="sparse_miss_read"):
        _llm(ckpt_with_basis, True, sparse_miss_read="bytes")


def test_tier_gpu_kv_cache_shrinks(ckpt_with_basis):
    """With the tier the full-attention layers hold no paged K/V on the device: only sketches."""
    off, on = _llm(ckpt_with_basis, False).engine.runner, _llm(ckpt_with_basis, True).engine.runner
    assert on.tier_layers and all(isinstance(m, TieredAttention) for m in on.attn_layers)
    assert all(m.k_cache.numel() == 0 and m.v_cache.numel() == 0 for m in on.tier_layers)
    assert on.kv_bytes_per_block < off.kv_bytes_per_block / 4
    c = on.model_cfg
    assert on.tier.store.row_bytes == c.num_kv_heads * 4 * c.head_dim  # bf16 K + V


def test_tier_residual_keys_cut_the_int4_error():
    """The reference model over held-out code (real keys: a random model's keys leave the basis little to explain):
    int4 host rows whose keys are residuals against their sketch drift less from tier-off than plain int4 rows, at
    the same bytes (768 tokens: KL 0.00015 vs 0.0012; benchmarks/results/int4-residual-keys-cpu-2026-12-03/ at 4K-16K)."""
    from sketchkv.config import default_model
    from sketchkv.eval.common import heldout_token_ids
    n, C = 768, 32
    ids = heldout_token_ids(default_model(), 2 * (n + C))
    prompts, conts = [ids[:n], ids[n + C:2 * n + C]], [ids[n:n + C], ids[2 * n + C:]]
    opts = dict(device="cpu", block_size=16, max_num_seqs=2, sparse=True, sparse_top_k=64, sparse_sink_tokens=32,
                sparse_recent_tokens=128, sparse_dense_threshold=0)
    ref = LLM(default_model(), **opts).teacher_force(prompts, conts)
    kl = {}
    for residual in (False, True):
        got = LLM(default_model(), **opts, sparse_host_tier=True, sparse_host_format="int4",
                  sparse_host_residual_keys=residual).teacher_force(prompts, conts)
        kl[residual] = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    assert kl[True] < 0.5 * kl[False], kl


@pytest.mark.parametrize("fmt,min_agree", [("int8", 0.95), ("int4", 0.8), ("k8v4", 0.9)])
def test_tier_quantized_top1_agreement(ckpt_with_basis, fmt, min_agree):
    """Teacher-forced continuations: the argmax with int4 / int8 / k8v4 host rows agrees with tier-off."""
    prompts = [_prompt(400, 6), _prompt(250, 7)]
    conts = [_prompt(40, 8), _prompt(40, 9)]
    ref = _llm(ckpt_with_basis, False).teacher_force(prompts, conts)
    got = _llm(ckpt_with_basis, True, fmt).teacher_force(prompts, conts)
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    assert agree >= min_agree, (agree, kl)
    assert kl < 0.05


@pytest.mark.parametrize("residual", [False, True])
def test_tier_follow_up_turn_reuses_prefix(ckpt_with_basis, residual):
    """A follow-up request whose prefix sits in the tier: its sinks / recent rows come from the host
    rows (no bulk copy; with residual keys, rebuilt from the sketch) and it decodes as tier-off does."""
    first = _prompt(300, 10)
    follow = first + _prompt(40, 11)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for tier in (False, True):   # (the same prefill either way: auto would select per chunk over the tier only)
        extra = {"sparse_host_residual_keys": residual} if tier else {}
        llm = _llm(ckpt_with_basis, tier, sparse_prefill_selection="dense", **extra)
        llm.generate(prompt_token_ids=[first], sampling_params=sp)
        out = llm.generate(prompt_token_ids=[follow], sampling_params=sp)[0]
        assert out.num_cached_tokens >= 256
        outs.append(out.token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("tier", [False, True])
def test_chunk_prefill_selection_with_topk_ge_context_is_dense_prefill(ckpt_with_basis, tier):
    """prefill_selection=chunk: with top_k >= the prefix a chunk picks every prefix token, in order, so chunked
    prefill (32-token chunks) gives bitwise the dense prefill's log-probabilities, paged or over the tier."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [_prompt(200, 30), _prompt(90, 31)]
    outs = [_llm(ckpt_with_basis, tier, sparse_top_k=4096, sparse_prefill_selection=sel, max_num_batched_tokens=32,
                 enable_prefix_caching=False).generate(prompt_token_ids=prompts, sampling_params=sp)
            for sel in ("dense", "chunk")]
    for d, c in zip(*outs):
        assert d.token_ids == c.token_ids and d.logprobs == c.logprobs


def test_chunk_prefill_selection_moves_only_picked_rows_for_a_follow_up(ckpt_with_basis):
    """A follow-up turn over a prefix in the host tier: dense prefill reads the whole prefix back from the host
    rows (each layer); with prefill_selection=chunk its prompt chunk reads only the sinks, its top-k picks and the
    recent tokens (4 + 16 + 8 rows per layer here), and the turn still answers close to the dense prefill's.
    (336 tokens: one chunk over the 288 cached; either way the new sequence's sinks + recent ring, 4 + 8 rows,
    are filled from the host first.)"""
    first = _prompt(300, 32)
    follow = first + _prompt(36, 33)
    sp, one = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), SamplingParams(temperature=0, max_tokens=1,
                                                                                           logprobs=0)
    read, logprobs = {}, {}
    for sel in ("dense", "chunk"):
        llm = _llm(ckpt_with_basis, True, sparse_prefill_selection=sel)
        llm.generate(prompt_token_ids=[first], sampling_params=sp)
        before = llm.tier_stats().pcie_read_bytes
        out = llm.generate(prompt_token_ids=[follow], sampling_params=one)[0]   # prefill only: no decode step
        cached = out.num_cached_tokens
        assert cached == 288
        tier = llm.engine.runner.tier
        read[sel] = (llm.tier_stats().pcie_read_bytes - before) / (tier.L * tier.store.row_bytes)
        logprobs[sel] = out.logprobs[0]
    assert read["dense"] == 4 + 8 + 288
    assert read["chunk"] == 4 + 8 + (4 + 16 + 8)
    assert abs(logprobs["dense"] - logprobs["chunk"]) < 0.5


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
    """hits + misses = picks looked up; PCIe reads = (misses + prefix rows read back by prompt chunks: the
    whole prefix or one selection's rows) x row bytes; PCIe writes = tokens forwarded x layers x row bytes;
    per-sequence host bytes = blocks x block bytes."""
    prompts = [_prompt(300, 18), _prompt(90, 19)]
    n_out = 10
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    llm = _llm(ckpt_with_basis, True, fmt="int4")
    eng, tier = llm.engine, llm.engine.runner.tier
    picks = prefix_rows = 0
    orig_compose, orig_prefix, orig_rows = tier.compose, tier.read_prefix, tier.read_rows

    def compose(layer, pos, counts, block_tables, seq_lens, state_slots, **out):
        nonlocal picks
        n = seq_lens.long()[:, None]
        p = pos.long()
        ok = torch.arange(p.shape[1])[None] < counts.long()[:, None]
        picks += int((ok & (p >= 4) & (p < torch.clamp(n - 8, min=4))).sum())
        return orig_compose(layer, pos, counts, block_tables, seq_lens, state_slots, **out)

    def read_prefix(layer, block_table, n, dtype):
        nonlocal prefix_rows
        prefix_rows += n
        return orig_prefix(layer, block_table, n, dtype)

    def read_rows(layer, block_table, pos, dtype):
        nonlocal prefix_rows
        prefix_rows += pos.shape[0]
        return orig_rows(layer, block_table, pos, dtype)
    tier.compose, tier.read_prefix, tier.read_rows = compose, read_prefix, read_rows
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


def test_prefill_selection_auto_is_chunk_over_the_tier_only(ckpt_with_basis):
    """auto: one selection per prompt chunk where a dense prefill would read the prefix back from host RAM."""
    assert _llm(ckpt_with_basis, True).engine.runner.cfg.sparse.prefill_selection == "chunk"
    assert _llm(ckpt_with_basis, False).engine.runner.cfg.sparse.prefill_selection == "dense"
    assert _llm(ckpt_with_basis, True, sparse_prefill_selection="dense").engine.runner.cfg.sparse.prefill_selection \
        == "dense"


def test_residual_keys_default_on_for_int4_rows_only(ckpt_with_basis):
    """sparse_host_residual_keys unset (auto): on with int4 host rows under the key sketch, off with other formats
    and without the tier; an explicit False stands."""
    runner = lambda **kw: _llm(ckpt_with_basis, **kw).engine.runner  # noqa: E731
    r = runner(tier=True, fmt="int4")
    assert r.residual_keys and r.tier.key_base is not None
    assert not runner(tier=True, fmt="bf16").residual_keys
    assert not runner(tier=True, fmt="k8v4").residual_keys
    assert not runner(tier=False).residual_keys
    r = runner(tier=True, fmt="int4", sparse_host_residual_keys=False)
    assert not r.residual_keys and r.tier.key_base is None


def test_tier_config_errors(ckpt_with_basis):
    from sketchkv.errors import RequestError
    with pytest.raises(RequestError, match="needs sparse decode"):
        LLM(ckpt_with_basis, device="cpu", sparse_host_tier=True)
    with pytest.raises(RequestError, match="shared_selection"):
        _llm(ckpt_with_basis, True, sparse_shared_selection=False)
    with pytest.raises(RequestError, match="sparse_prefill_selection must be auto, dense or chunk"):
        _llm(ckpt_with_basis, False, sparse_prefill_selection="sparse")
    with pytest.raises(RequestError, match="sparse_prefill_selection=chunk needs sparse_shared_selection"):
        _llm(ckpt_with_basis, False, sparse_prefill_selection="chunk", sparse_shared_selection=False)
    with pytest.raises(RequestError, match="sparse_host_residual_keys needs the host tier"):
        _llm(ckpt_with_basis, False, sparse_host_residual_keys=True)
    with pytest.raises(CapacityError, match="holds no KV block"):
        _llm(ckpt_with_basis, True, sparse_host_budget_gb=1e-9)
    with pytest.raises(CapacityError, match="below the host tier's fixed part"):
        _llm(ckpt_with_basis, True, sparse_gpu_budget_gb=1e-9)


# ---- kernels of one tiered step under the interpreter ----------------------------------------------

@needs_interp
@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_interp_tier_step_matches_reference(fmt, kernel):
    """HostTier.gather (scratch composition: PyTorch or the fused kernel; zero-copy gather kernel for
    misses) + the paged decode kernel over the compact scratch equals exact attention over the same
    rows dequantised by the reference."""
    from sketchkv.kv.host_tier import ATTN_BLOCK, HostTier
    from sketchkv.ops.sparse_attention import sparse_attention_ref
    torch.manual_seed(0)
    Hq, Hkv, D, bs, S, R = 4, 2, 32, 16, 4, 8
    tier = HostTier(1, 12, bs, Hkv, D, fmt=fmt, sinks=S, recent=R, hot_fraction=0.1, num_state_slots=3,
                    max_model_len=160, pool_rows=64, dtype=torch.float32, device=torch.device("cpu"), kernel=kernel)
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
        kk, vv, miss, rec = tier.gather(0, idx, counts, tables, seq_lens, torch.tensor([0, 1]))
        B, Np = miss.shape
        nb = Np // ATTN_BLOCK
        t = (torch.arange(B, dtype=torch.int32)[:, None] * nb + torch.arange(nb, dtype=torch.int32)[None])
        out = pa.paged_attention_decode(q, kk.view(B * nb, ATTN_BLOCK, Hkv, D), vv.view(B * nb, ATTN_BLOCK, Hkv, D),
                                        t, counts, D ** -0.5)
        placed = tier.admit(0, pids, miss, rec)
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
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_gpu_tier_step_in_cuda_graph_matches_reference(kernel):
    """27B head shape (4 KV heads x 256), bf16 rows in pinned memory: one tiered step (gather: resident
    sinks / tail, hot hits, zero-copy misses -> paged kernel over the scratch -> admit) captured in a
    CUDA graph and replayed with new picks equals the sparse kernel over a GPU cache of the same rows;
    the counters advance inside the graph (hits grow as picks repeat)."""
    from sketchkv.kv.host_tier import ATTN_BLOCK, HostTier
    from sketchkv.ops.sparse_attention import sparse_attention
    torch.manual_seed(0)
    dev = torch.device("cuda")
    Hq, Hkv, D, bs, S, R, L = 24, 4, 256, 64, 64, 1024, 1
    lens, nblk = [12000, 7000], 200
    tier = HostTier(L, nblk, bs, Hkv, D, fmt="bf16", sinks=S, recent=R, hot_fraction=0.025, num_state_slots=3,
                    max_model_len=16384, pool_rows=4096, dtype=torch.bfloat16, device=dev, kernel=kernel)
    assert tier.store.buf.is_pinned()
    width = 190
    perm = torch.randperm(nblk - 1) + 1
    tables = torch.stack([perm[:width], perm[:width].flip(0)]).int().to(dev)  # (shared blocks are fine)
    tables[1, 110:] = -1
    kc = torch.zeros(nblk, bs, Hkv, D, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    for b, n in enumerate(lens[:1]):  # sequence 1 reads sequence 0's rows through its own table order
        pos = torch.arange(n, device=dev)
        slots = tables[b, pos // bs].long() * bs + pos % bs
        k = torch.randn(n, Hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kc.view(-1, Hkv, D)[slots], vc.view(-1, Hkv, D)[slots] = k, v
    for b, n in enumerate(lens):  # resident rows of each sequence, from the cache
        pos = torch.arange(n, device=dev)
        slots = tables[b, pos // bs].long() * bs + pos % bs
        rows = torch.tensor([tier.resident_row(b, p, n) for p in range(n)], device=dev)
        tier.write(0, slots, rows, kc.view(-1, Hkv, D)[slots], vc.view(-1, Hkv, D)[slots])
    pids = torch.tensor([tier.hot.add_sequence(rows=300), tier.hot.add_sequence(rows=175)], device=dev)
    K = 2048
    N = S + K + R
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    states = torch.tensor([0, 1], device=dev)
    g = torch.Generator().manual_seed(1)

    def picks():
        idx = torch.full((2, N), 2**31 - 1, dtype=torch.int32)
        for b, n in enumerate(lens):  # a small pool of candidates: later steps hit
            cand = torch.randperm(n - R - S, generator=g)[:K] % 3000 + S
            x = torch.cat([torch.arange(S), torch.unique(cand), torch.arange(n - R, n)])
            idx[b, :len(x)] = x.int()
        return idx.to(dev), (idx < 2**31 - 1).sum(-1).int().to(dev)
    q = torch.randn(2, Hq, D, device=dev, dtype=torch.bfloat16)
    s_idx, s_counts = picks()

    def step():
        k, v, miss, rec = tier.gather(0, s_idx, s_counts, tables, seq_lens, states)
        B, Np = miss.shape
        nb = Np // ATTN_BLOCK
        t = (torch.arange(B, device=dev, dtype=torch.int32)[:, None] * nb
             + torch.arange(nb, device=dev, dtype=torch.int32)[None])
        out = pa.paged_attention_decode(q, k.view(B * nb, ATTN_BLOCK, Hkv, D), v.view(B * nb, ATTN_BLOCK, Hkv, D),
                                        t, s_counts, D ** -0.5)
        tier.admit(0, pids, miss, rec, graph=True)
        return out
    step()  # warm-up: compiles, admits
    torch.cuda.synchronize()
    tier.store.wait()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = step()
    before = tier.stats()
    for _ in range(4):
        idx, counts = picks()
        s_idx.copy_(idx)
        s_counts.copy_(counts)
        tier.store.wait()
        graph.replay()
        ref = sparse_attention(q, kc, vc, tables, s_idx[:, None], s_counts, D ** -0.5)
        torch.testing.assert_close(g_out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    after = tier.stats()
    assert after.hits > before.hits and after.misses > before.misses
    assert after.pcie_read_bytes - before.pcie_read_bytes == (after.misses - before.misses) * tier.store.row_bytes


@pytest.fixture(scope="module")
def gpu_ckpt(tmp_path_factory):
    """A tiny qwen3 (no GDN layers: no fla autotuning on the GPU) with a key basis fitted in bf16 on the GPU."""
    import os
    from conftest import make_checkpoint
    from sketchkv.kv.fit_basis import fit_basis
    path = str(tmp_path_factory.mktemp("gpu_tier") / "qwen3")
    make_checkpoint(path, "qwen3", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                    num_hidden_layers=3, max_position_embeddings=8192)
    calib = os.path.join(path, "calib.txt")
    g = torch.Generator().manual_seed(5)
    with open(calib, "w") as f:
        f.write("".join(chr(c) for c in torch.randint(32, 127, (20000,), generator=g).tolist()))
    fit = LLM(path, device="cuda", enforce_eager=True, max_num_seqs=2, max_model_len=8192, gpu_memory_utilization=0.3)
    fit_basis(fit, [calib], rank=16, max_tokens=8000, seq_len=2048, out=os.path.join(path, "key_basis.safetensors"))
    return path


GPU_OPTS = dict(device="cuda", max_num_seqs=4, max_model_len=8192, max_num_batched_tokens=2048, sparse=True,
                sparse_top_k=256, sparse_sink_tokens=64, sparse_recent_tokens=128, sparse_dense_threshold=0,
                gpu_memory_utilization=0.3)


@pytest.mark.gpu
@needs_cuda
def test_gpu_tier_engine_matches_tier_off(gpu_ckpt):
    """CUDA graphs, teacher-forced: the tier with bf16 rows (pinned, zero-copy misses) gives tier-off's
    distributions up to rounding; int4 rows stay close; so do both with residual keys ("r": host K rows minus
    their sketch's part, added back on every read)."""
    import gc
    path = gpu_ckpt
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6000, 3000, 900)]
    conts = [torch.randint(3, 500, (64,), generator=g).tolist() for _ in prompts]
    opts = {**GPU_OPTS, "sparse_prefill_selection": "dense"}   # the same prefill with and without the tier
    res = {}
    llm = r = None
    for fmt in (None, "bf16", "int4", "bf16r", "int4r"):
        llm = r = None  # one engine at a time: each sizes its caches from the free memory
        gc.collect()
        torch.cuda.empty_cache()
        tier = dict(sparse_host_tier=True, sparse_host_format=fmt[:4],
                    sparse_host_residual_keys=fmt.endswith("r")) if fmt else {}
        llm = LLM(path, **opts, **tier)
        r = llm.engine.runner
        assert r.graphs and (fmt is None or r.tier.store.buf.is_pinned())
        got = llm.teacher_force(prompts, conts)
        if fmt is None:
            ref = got
            continue
        kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
        agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
        s = llm.tier_stats()
        res[fmt] = (kl, agree)
        assert s.hits > 0 and s.misses > 0 and s.pcie_read_bytes >= s.misses * r.tier.store.row_bytes
    assert res["bf16"][0] < 1e-3 and res["bf16"][1] >= 0.95, res
    assert res["int4"][0] < 2e-2 and res["int4"][1] >= 0.8, res
    assert res["bf16r"][0] < 1e-3 and res["bf16r"][1] >= 0.95, res
    assert res["int4r"][0] < 2e-2 and res["int4r"][1] >= 0.8, res


@pytest.mark.gpu
@needs_cuda
def test_gpu_key_base_in_attention_same_logits(gpu_ckpt, monkeypatch):
    """int4 host rows with residual keys, read groups 2, decode graphs: the keys' sketch base added inside the decode
    kernel's scores (tiered_attention.KEY_BASE_IN_ATTENTION) gives the log-probabilities of the base rewritten into
    the K scratch (fp32 model: only the base's rounding differs: basis^T q in fp16 against the rewrite's tf32 dot)."""
    import gc
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6000, 3000, 900)]
    conts = [torch.randint(3, 500, (64,), generator=g).tolist() for _ in prompts]
    got = {}
    for fold in (False, True):
        monkeypatch.setattr(tiered_attention, "KEY_BASE_IN_ATTENTION", fold)
        llm = None
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_ckpt, **GPU_OPTS, dtype="float32", sparse_host_tier=True, sparse_host_format="int4",
                  sparse_read_groups=2)
        assert llm.engine.runner.graphs and llm.engine.runner.tier.key_base is not None
        got[fold] = llm.teacher_force(prompts, conts)
        s = llm.tier_stats()
        assert s.hits > 0 and s.misses > 0
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(got[False], got[True])]).mean().item()
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(got[False], got[True])]).mean().item()
    assert kl < 1e-4 and agree >= 0.98, (kl, agree)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tier", [False, True])
def test_gpu_chunk_prefill_selection(gpu_ckpt, tier):
    """prefill_selection=chunk on the GPU (tensor-core scoring of 16 rows x G query heads, pinned host rows
    read by the zero-copy gather, cuDNN prefill attention): with top_k >= the prefix, chunked prefill gives the
    dense prefill's log-probabilities up to rounding (bf16 model: the picks come out in order, only the
    kernels' split differs); with the default-sized top_k a follow-up turn stays close to the dense prefill's."""
    import gc
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5000, 2600)]
    follow = [p + torch.randint(3, 500, (300,), generator=g).tolist() for p in prompts]
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    opts = {**GPU_OPTS, "max_num_batched_tokens": 512, **(dict(sparse_host_tier=True, sparse_host_format="bf16")
                                                             if tier else {})}
    res = {}
    for top_k, sel in ((8192, "dense"), (8192, "chunk"), (256, "chunk")):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_ckpt, **{**opts, "sparse_top_k": top_k}, sparse_prefill_selection=sel)
        first = [o.logprobs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=one)]
        before = llm.tier_stats().pcie_read_bytes if tier else 0
        outs = llm.generate(prompt_token_ids=follow, sampling_params=one)
        assert all(o.num_cached_tokens >= len(p) - 512 for o, p in zip(outs, prompts))
        res[(top_k, sel)] = (first, [o.logprobs[0] for o in outs],
                             llm.tier_stats().pcie_read_bytes - before if tier else 0)
        del llm
    dense, full, small = res[(8192, "dense")], res[(8192, "chunk")], res[(256, "chunk")]
    assert max(abs(a - b) for a, b in zip(dense[0] + dense[1], full[0] + full[1])) < 5e-2, res
    assert max(abs(a - b) for a, b in zip(dense[1], small[1])) < 1.0, res
    if tier:   # the follow-up's chunk reads its picks, not the whole prefix
        assert small[2] < dense[2] / 4, res


@pytest.mark.gpu
@needs_cuda
def test_gpu_admit_stream_same_tokens_and_hits(gpu_ckpt):
    """Admits on the side stream (the default) against the current stream, CUDA graphs, int4 rows: the same greedy
    tokens and the same hot-buffer hits and misses (the overlap changes when the admit runs, not what it does)."""
    import gc
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6000, 4000, 2500, 900)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    out = {}
    for stream in (True, False):
        llm = None
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_ckpt, **GPU_OPTS, sparse_host_tier=True, sparse_admit_stream=stream)
        assert llm.engine.runner.graphs and (llm.engine.runner.tier.admit_stream is not None) == stream
        toks = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
        s = llm.tier_stats()
        out[stream] = (toks, s.hits, s.misses)
        assert s.hits > 0 and s.misses > 0
    assert out[True] == out[False]


@pytest.mark.gpu
@needs_cuda
def test_gpu_read_groups_same_tokens_and_hits(gpu_ckpt, monkeypatch):
    """sparse_read_groups=3 (each group's host reads on the read stream, overlapping the next group's scoring; its
    hits and attention after them on the read stream, or on the attend stream, overlapping the next group's reads;
    its compose on the read stream or on the main stream; inside the decode CUDA graphs) against one group, fp32 (the decode kernel's splits follow the batch size): the
    same greedy tokens and hot-buffer hits and misses."""
    import gc
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6000, 4000, 2500, 900)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    out = {}
    for groups, attend, compose_read in ((1, False, True), (3, False, True), (3, True, True), (3, True, False)):
        monkeypatch.setattr(host_tier, "ATTEND_STREAM", attend)
        monkeypatch.setattr(host_tier, "COMPOSE_ON_READ_STREAM", compose_read)
        llm = None
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(gpu_ckpt, **GPU_OPTS, dtype="float32", sparse_host_tier=True, sparse_host_format="int4",
                  sparse_read_groups=groups)
        tier = llm.engine.runner.tier
        assert llm.engine.runner.graphs and (tier.read_stream is not None) == (groups > 1)
        assert (tier.attend_stream is not None) == attend
        toks = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
        s = llm.tier_stats()
        out[groups, attend, compose_read] = (toks, s.hits, s.misses)
        assert s.hits > 0 and s.misses > 0
    assert out[1, False, True] == out[3, False, True] == out[3, True, True] == out[3, True, False]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_gpu_tier_decode_step_no_host_sync(gpu_ckpt, kernel):
    """One eager tiered decode forward (write, select, gather, attention, admit) with sync debug = error."""
    llm = LLM(gpu_ckpt, **{**GPU_OPTS, "enforce_eager": True}, sparse_host_tier=True, sparse_tier_kernel=kernel)
    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    eng.add_request(torch.randint(3, 500, (5000,), generator=g).tolist(),
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


def _tier_speculation_case(path, **kw):
    """Three prompts through chunked prefill and mixed steps, and the tier's greedy tokens without speculation:
    (prompts, sampling params, engine options, reference tokens)."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [_prompt(300, 31), _prompt(150, 32), _prompt(40, 33)]
    kw = dict(dtype="float32", max_num_batched_tokens=128, **kw)
    ref = [o.token_ids for o in _llm(path, True, **kw).generate(prompt_token_ids=prompts, sampling_params=sp)]
    return prompts, sp, kw, ref


@pytest.mark.parametrize("drafter", ["oracle", "mtp"])
def test_tier_with_speculative_decoding_same_tokens(ckpt_with_basis_and_mtp, drafter):
    """MTP verification over the host tier: each row of a sequence (its token and its drafts) selects and
    reads for its own position (the recent ring holds R + n rows, so the earliest row still finds its
    last R tokens), misses of the first row are admitted, rejected drafts' rows are overwritten later:
    greedy tokens equal the tier without speculation, through chunked prefill and mixed steps."""
    from test_speculative import assert_speculation_keeps_tokens
    path = ckpt_with_basis_and_mtp
    prompts, sp, kw, ref = _tier_speculation_case(path)
    llm = _llm(path, True, num_speculative_tokens=3, **kw)
    assert_speculation_keeps_tokens(llm, prompts, sp, ref, drafter)
    tier = llm.engine.runner.tier
    assert tier.ring == 8 + 3 and tier.width == 4 + 11
    s = llm.tier_stats()
    assert s.hits > 0 and s.misses > 0
    _, counts = llm.engine.runner.sparse_layers[0].last_indices
    assert (counts == 4 + 16 + 8).all()   # the sparse tiered path ran on the verified rows


def test_tier_verification_graph_steps_give_the_same_tokens(ckpt_with_basis_and_mtp, eager_graphs, monkeypatch):
    """Verification graphs over the host tier (emulated eagerly on CPU): per-row resident rows and hot
    partitions, only a sequence's first row admits; tokens equal the tier without speculation."""
    from test_speculative import assert_speculation_keeps_tokens
    path = ckpt_with_basis_and_mtp
    prompts, sp, kw, ref = _tier_speculation_case(path)
    eager = _llm(path, True, num_speculative_tokens=3, **kw)
    assert_speculation_keeps_tokens(eager, prompts, sp, ref, "oracle")
    # verification graphs per length bucket (here 2K, 4K, 8K = max_model_len); these short prompts replay 2K's
    from sketchkv.engine import model_runner
    monkeypatch.setattr(model_runner, "FIRST_LENGTH_BUCKET", 2048)
    llm = _llm(path, True, num_speculative_tokens=3, **kw)
    r = eager_graphs(llm.engine.runner)
    assert sorted(r.verify_graphs) == [(True, b, nb) for b in (1, 2, 4) for nb in (128, 256, 512)]
    assert_speculation_keeps_tokens(llm, prompts, sp, ref, "oracle")
    used = {k for k, g in r.verify_graphs.items() if type(g).count}
    assert used and all(nb == 128 for _, _, nb in used), used
    assert sum(type(g).count for g in r.replay_graphs.values()) > 0
    # the same hot-buffer traffic as eager verification (partitions per row, first-row admits)
    got, want = llm.tier_stats(), eager.tier_stats()
    assert (got.hits, got.misses) == (want.hits, want.misses)


def test_tier_shared_verification_selection_covers_the_drafts(ckpt_with_basis_and_mtp, eager_graphs):
    """sparse_verify_selection=shared over the host tier: each verification row reads the first row's
    picks plus the tokens from its recent window up to itself, all resident in the ring (R + n rows).
    With top-k covering the context that is every token; the few a row reads from the ring where plain
    decoding reads host rows differ by bf16 rounding only, and these prompts' greedy tokens equal the tier
    without speculation (with int4 rows they need not: tests/test_gpu_speculative.py). A
    sequence's rows are read from the tier once per step (its last row's positions hold the others'):
    fewer host-tier lookups than per-row verification; the same in verification graphs (emulated)."""
    from test_speculative import assert_speculation_keeps_tokens
    path = ckpt_with_basis_and_mtp
    prompts, sp, kw, ref = _tier_speculation_case(path, sparse_top_k=512, sparse_verify_selection="shared")
    llm = _llm(path, True, num_speculative_tokens=3, **kw)
    assert_speculation_keeps_tokens(llm, prompts, sp, ref, "oracle")
    per_row = _llm(path, True, num_speculative_tokens=3, **{**kw, "sparse_verify_selection": "per_row"})
    assert_speculation_keeps_tokens(per_row, prompts, sp, ref, "oracle")
    s, p = llm.tier_stats(), per_row.tier_stats()
    assert 0 < s.hits + s.misses < (p.hits + p.misses) / 2, (s, p)
    graphs = _llm(path, True, num_speculative_tokens=3, **kw)
    r = eager_graphs(graphs.engine.runner)
    assert_speculation_keeps_tokens(graphs, prompts, sp, ref, "oracle")
    assert sum(type(g).count for g in r.verify_graphs.values()) > 0
    g = graphs.tier_stats()
    assert (g.hits, g.misses) == (s.hits, s.misses)


@pytest.mark.parametrize("tier", [False, True])
def test_decode_graphs_per_length_bucket(eager_graphs, tier):
    """Sparse decode graphs come per length bucket (16K, 32K, ... max_model_len blocks per sequence):
    selection in a graph spans the whole block table, so a short context replays a short graph. Emulated
    on CPU; tokens equal eager decoding."""
    opts = dict(device="cpu", block_size=16, max_num_seqs=2, max_model_len=32768, sparse=True, sparse_top_k=16,
                sparse_sink_tokens=4, sparse_recent_tokens=8, sparse_dense_threshold=0)
    if tier:
        opts.update(sparse_host_tier=True, sparse_host_format="bf16")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [_prompt(300, 41), _prompt(90, 42)]
    ref = [o.token_ids for o in LLM("random:tiny-hybrid", **opts).generate(prompt_token_ids=prompts, sampling_params=sp)]
    llm = LLM("random:tiny-hybrid", **opts)
    r = eager_graphs(llm.engine.runner)
    assert sorted({k[2] for k in r.graphs}) == [16384 // 16, 32768 // 16]
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert got == ref
    replays = {k: type(g).count for k, g in r.graphs.items() if type(g).count}
    assert replays and all(k[2] == 1024 for k in replays), replays   # the 16K graphs, never the 32K ones


@pytest.mark.gpu
@needs_cuda
def test_gpu_memory_gb_caps_the_engine_and_refuses_weights_past_it(gpu_ckpt):
    """gpu_memory_gb: the engine sizes its caches against the cap (not the card) and its allocator refuses
    past it; weights larger than the cap are a one-line CapacityError at load, not an out-of-memory trace."""
    import gc
    cap = 2.0
    try:
        llm = LLM(gpu_ckpt, device="cuda", max_num_seqs=4, max_model_len=8192, gpu_memory_gb=cap)
        torch.cuda.reset_peak_memory_stats()
        out = llm.generate(prompt_token_ids=[_prompt(3000, seed=1)],
                           sampling_params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 16
        peak = torch.cuda.max_memory_allocated()
        kv = llm.engine.runner.num_blocks * llm.engine.runner.kv_bytes_per_block
        assert 0.5 * 2**30 < kv < 0.9 * cap * 2**30 and peak <= cap * 2**30, (kv, peak)
        llm = None
        gc.collect()
        torch.cuda.empty_cache()
        with pytest.raises(CapacityError, match="do not fit this GPU .*gpu_memory_gb=0.001"):
            LLM(gpu_ckpt, device="cuda", gpu_memory_gb=0.001)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
