"""MTP speculative decoding: greedy exactness, GDN rollback, rejection sampling keeps the distribution."""
import random

import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.engine.context import Context, set_context
from sketchkv.engine.sequence import Status
from sketchkv.engine.speculative import verify_rows
from sketchkv.errors import RequestError
from sketchkv.layers.gated_deltanet import GatedDeltaNet
from sketchkv.layers.rejection_sampler import accept
from sketchkv.layers.sampler import _filter
from conftest import add_mtp, make_checkpoint


class OracleDrafter:
    """Test-only drafter: proposes the target's own greedy continuation (known from a run without
    speculation), wrong at a random position in about half the steps, so steps accept anything from
    0 to k drafts and the rollback paths all run."""

    def __init__(self, reference: dict[tuple, list[int]], vocab: int, seed: int = 0):
        self.reference, self.vocab, self.rng = reference, vocab, random.Random(seed)

    def catch_up(self, items, hidden) -> None:
        for seq, s, n, _ in items:
            if seq.status == Status.RUNNING and s + n == len(seq) - 1:
                seq.spec_ready = True

    def propose(self, seqs, ks) -> None:
        for seq, k in zip(seqs, ks):
            ref = self.reference[tuple(seq.prompt_token_ids)]
            d = (ref[len(seq):len(seq) + k] + [0] * k)[:k]
            if self.rng.random() < 0.5:
                j = self.rng.randrange(k)
                d[j] = (d[j] + 1) % self.vocab
            seq.draft_token_ids, seq.draft_probs = d, None


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mtp") / "q35")
    make_checkpoint(path, "qwen3_5_text")
    add_mtp(path)
    return path


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _llm(path, **kw):
    return LLM(path, device="cpu", dtype="float32", block_size=16, **kw)


@pytest.mark.parametrize("n", [1, 3])
def test_greedy_tokens_identical_with_mtp_drafts(mtp_ckpt, n):
    """Several sequences, chunked prefill mixed with verification steps (continuous batching)."""
    prompts = _prompts((5, 77, 140, 33), 2)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    ref = _llm(mtp_ckpt, max_num_batched_tokens=64).generate(prompt_token_ids=prompts, sampling_params=sp)
    llm = _llm(mtp_ckpt, max_num_batched_tokens=64, num_speculative_tokens=n)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    for r, o in zip(ref, got):
        assert o.token_ids == r.token_ids and o.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
        assert [t[0][0] for t in o.top_logprobs] == o.token_ids
    m = llm.speculative_metrics()
    assert m["spec_verifications"] > 0 and m["spec_draft_tokens"] >= m["spec_verifications"]
    assert llm.engine.stats["spec_mean_accepted_length"] == m["spec_mean_accepted_length"] >= 1.0
    blocks = llm.engine.blocks
    assert blocks.num_free == blocks.num_blocks - 1  # every block came back


@pytest.mark.parametrize("drafter", ["mtp", "oracle"])
def test_verification_graph_steps_give_the_same_tokens(mtp_ckpt, eager_graphs, drafter):
    """Steady-state verification steps (every sequence: its token + n drafts) replay a verification graph
    of bucket x (1 + n) rows (emulated eagerly on CPU: the same static buffers, padding and row lists), and
    the commit's GDN replay its graph; steps with fewer drafts or prompt chunks stay eager; tokens equal
    non-speculative decoding."""
    prompts = _prompts((9, 60, 31), 6)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in _llm(mtp_ckpt, max_num_seqs=4).generate(prompt_token_ids=prompts, sampling_params=sp)]
    llm = _llm(mtp_ckpt, max_num_seqs=4, num_speculative_tokens=3)
    r = eager_graphs(llm.engine.runner)
    assert sorted(k[:2] for k in r.verify_graphs) == [(False, 1), (False, 2), (False, 4)]   # (dense, batch)
    assert_speculation_keeps_tokens(llm, prompts, sp, ref, drafter)
    replays = {k[:2]: type(g).count for k, g in r.verify_graphs.items()}
    assert replays[(False, 4)] > 0, replays   # 3 sequences -> the bucket of 4 (one padded sequence)
    # the commit's GDN replay from its graphs too (all 1 + n positions, padded rows on the scratch slot)
    assert sorted(r.replay_graphs) == [1, 2, 4] and sum(type(g).count for g in r.replay_graphs.values()) > 0
    if drafter == "mtp":  # and the drafter's catch-up over the verified rows (the oracle drafter has none)
        catch_ups = r.spec.drafter.catch_up_graphs
        assert sorted(catch_ups) == [(1, None), (2, None), (4, None)] and type(catch_ups[(4, None)]).count > 0


def _drafts_and_tokens(llm, prompts, sp):
    """Generated tokens and every step's drafts (per sequence, in batch order)."""
    drafter, steps = llm.engine.runner.spec.drafter, []
    propose = drafter.propose

    def recording(seqs, ks):
        propose(seqs, ks)
        steps.append([list(s.draft_token_ids) for s in seqs])
    drafter.propose = recording
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)], steps


@pytest.mark.parametrize("window", [4096, 0])
def test_drafter_graph_drafts_like_eager(mtp_ckpt, eager_graphs, window):
    """Greedy steps where every sequence drafts n tokens replay one drafter graph per step (emulated
    eagerly on CPU: static buffers, positions and slots computed on the device, a padded row), and
    draft exactly what eager drafting drafts; steps with fewer drafts (near max_tokens) stay eager. The
    catch-up after a graph verification runs over all 1 + n rows (rejected ones with filler tokens) and
    leaves the drafts unchanged, with the windowed drafter's ring and with the dense drafter's paged K/V."""
    prompts = _prompts((9, 60, 31), 6)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = dict(max_num_seqs=4, num_speculative_tokens=3, mtp_attention_window=window)
    want = _drafts_and_tokens(_llm(mtp_ckpt, **opts), prompts, sp)
    llm = _llm(mtp_ckpt, **opts)
    drafter = eager_graphs(llm.engine.runner).spec.drafter
    assert sorted(drafter.graphs) == [1, 2, 4]
    assert _drafts_and_tokens(llm, prompts, sp) == want
    assert type(drafter.graphs[4]).count > 0   # 3 sequences -> the bucket of 4
    # catch-ups over all 1 + n rows draft the same; the windowed drafter's serve every length, the paged
    # drafter's read the block tables: one per length bucket of the verification graphs
    assert sum(type(g).count for k, g in drafter.catch_up_graphs.items() if k[0] == 4) > 0
    assert all((k[1] is None) == (window > 0) for k in drafter.catch_up_graphs)


def _run_with_oracle(llm, prompts, sp, reference, seed=0):
    eng = llm.engine
    eng.runner.spec.drafter = OracleDrafter(reference, eng.model_config.vocab_size, seed)
    seqs = [eng.add_request(p, sp) for p in prompts]
    while eng.has_unfinished:
        eng.step()
        for s in eng.scheduler.running:  # rejected drafts' fresh blocks were freed
            bs = eng.blocks.block_size
            assert -(-s.num_cached // bs) <= len(s.block_table) <= -(-len(s) // bs)
            assert s.num_cached == len(s) - 1
    return [s.output_token_ids for s in seqs]


def assert_speculation_keeps_tokens(llm, prompts, sp, ref, drafter: str) -> None:
    """`llm` (speculative) gives the greedy tokens `ref` of non-speculative decoding, drafting with its
    MTP layer or with a mostly-right oracle (multi-token acceptance and rollbacks)."""
    if drafter == "mtp":
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    else:
        got = _run_with_oracle(llm, prompts, sp, {tuple(p): p + r for p, r in zip(prompts, ref)})
        assert llm.engine.runner.spec.metrics()["spec_mean_accepted_length"] > 1.5
    assert got == ref


@pytest.mark.parametrize("drafter", ["oracle", "mtp"])
def test_prompt_remainder_step_without_drafts_keeps_tokens(mtp_ckpt, drafter):
    """A prompt of 16k + 1 tokens (block size 16) is prefilled up to its last block boundary (a GDN snapshot
    point), then its last token alone: a step without drafts, whose GDN layers advance the state slots in
    place. The commit must not replay it from kept verification inputs (it did, stepping the conv state
    twice: H200 run 30 and sketchkv-on-CPU found it with the GPU test's checkpoint)."""
    prompts = _prompts((17, 33, 40), 5)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for batch in ([prompts[0]], prompts):
        ref = [o.token_ids for o in _llm(mtp_ckpt).generate(prompt_token_ids=batch, sampling_params=sp)]
        assert_speculation_keeps_tokens(_llm(mtp_ckpt, num_speculative_tokens=3), batch, sp, ref, drafter)


@pytest.mark.parametrize("n", [3, 7])
def test_forced_acceptance_multi_token_steps_identical(mtp_ckpt, n):
    """A drafter that is mostly right: steps accept several drafts, sequences in one batch accept
    different counts, and GDN state / KV / blocks roll back to the accepted position."""
    prompts = _prompts((9, 60, 31), 4)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in _llm(mtp_ckpt).generate(prompt_token_ids=prompts, sampling_params=sp)]
    reference = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm = _llm(mtp_ckpt, num_speculative_tokens=n, max_num_batched_tokens=48)
    assert _run_with_oracle(llm, prompts, sp, reference) == ref
    m = llm.engine.runner.spec.metrics()
    assert m["spec_mean_accepted_length"] > 2.0
    assert 0 < m["spec_acceptance_rate"] < 1  # some steps rejected a draft
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks - 1


def test_stop_inside_accepted_drafts_truncates(mtp_ckpt):
    prompt = _prompts((12,), 5)[0]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = _llm(mtp_ckpt).generate(prompt_token_ids=[prompt], sampling_params=sp)[0].token_ids
    stop = full[9]
    want = full[:full.index(stop) + 1]
    llm = _llm(mtp_ckpt, num_speculative_tokens=5)
    got = _run_with_oracle(llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                         stop_token_ids=[stop]), {tuple(prompt): prompt + full})
    assert got == [want]
    got = _run_with_oracle(_llm(mtp_ckpt, num_speculative_tokens=5), [prompt],
                           SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), {tuple(prompt): prompt + full})
    assert got == [full[:7]]


def test_preemption_and_prefix_cache_with_speculation(mtp_ckpt):
    """Few KV blocks: sequences get preempted (recompute) and re-admitted mid-speculation."""
    prompts = _prompts((40, 45, 50), 6)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in _llm(mtp_ckpt).generate(prompt_token_ids=prompts, sampling_params=sp)]
    reference = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm = _llm(mtp_ckpt, num_speculative_tokens=4, num_kv_blocks=12)
    assert _run_with_oracle(llm, prompts, sp, reference) == ref
    assert llm.engine.scheduler.num_preemptions > 0


@torch.no_grad()
def test_mtp_layer_matches_training_reference(tmp_path, monkeypatch):
    """The MTP pass over a prompt gives the logits of scripts/train_reference.py's MTP (transformers'
    decoder layer; h_t and token t+1 at position t), so a trained MTP layer drafts as it was trained."""
    import json
    import os
    import sys
    from safetensors.torch import load_file, save_file
    from sketchkv.engine.speculative import MTPDrafter
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import train_reference
    path = str(tmp_path / "q")
    hf = make_checkpoint(path, "qwen3_5_text")
    torch.manual_seed(3)
    mtp = train_reference.make_mtp(hf.config).eval()
    for name, p in mtp.named_parameters():
        p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
    w = load_file(os.path.join(path, "model.safetensors"))
    w.update({f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()})
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "mtp_num_hidden_layers": 1}, open(os.path.join(path, "config.json"), "w"))
    seen = []
    orig = MTPDrafter._mtp
    monkeypatch.setattr(MTPDrafter, "_mtp", lambda self, *a: seen.append(orig(self, *a)) or seen[-1])
    llm = _llm(path, num_speculative_tokens=1)
    prompt = _prompts((40,), 8)[0]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=1))[0]
    ids = torch.tensor([prompt + out.token_ids])
    ref = train_reference.mtp_forward(hf, mtp, ids, hf.model(input_ids=ids).last_hidden_state)[0]
    got = llm.engine.model.compute_logits(torch.cat(seen))  # the prompt ran in two chunks (a snapshot point)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# ---- GDN rollback ------------------------------------------------------------------------------

def _gdn(seed=0):
    torch.manual_seed(seed)
    m = GatedDeltaNet(hidden=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4, eps=1e-6)
    with torch.no_grad():
        m.conv1d.weight.normal_(0, 0.5)
        m.A_log.uniform_(-1, 1)
        m.dt_bias.normal_(0, 0.5)
    return m.eval()


def _bind(m, S, rows):
    conv, rec = m.state_shapes()
    g = torch.Generator().manual_seed(3)
    m.conv_state = torch.randn(S, *conv, generator=g)
    m.ssm_state = torch.randn(S, *rec, generator=g) * 0.1
    m.allocate_verify(rows, torch.float32, "cpu")


def _step_ctx(slot):
    return Context(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([9], dtype=torch.int32),
                   slot_mapping=torch.tensor([0]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                   state_slots=torch.tensor([slot]), query_lens=[1], context_lens=[8], is_decode=True, max_seq_len=9)


@torch.no_grad()
@pytest.mark.parametrize("buffer_rows", [32, 4])   # 4: the step is larger than the kept-input buffers (eager)
def test_gdn_verify_replays_to_step_by_step_state(buffer_rows):
    """Verification of 4 + 2 + 1 rows next to a 5-token prompt chunk: every row's output equals
    one-token-at-a-time decoding; the decoding slots keep their state until the replay, which leaves
    exactly the state after a + 1 single steps (conv and recurrent) for accepted position a, keeps the
    snapshots asked for, and touches no other slot but the scratch one."""
    S, scratch = 7, 6
    m = _gdn()
    qlens, slots, decoding = [4, 5, 2, 1], [3, 0, 5, 1], [True, False, True, True]
    cu = [0, 4, 9, 11, 12]
    x = torch.randn(cu[-1], 32)
    _bind(m, S, buffer_rows)
    conv0, ssm0 = m.conv_state.clone(), m.ssm_state.clone()
    ctx = Context(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(qlens, dtype=torch.int32) + 8,
                  slot_mapping=torch.zeros(cu[-1], dtype=torch.int64), block_tables=torch.zeros(4, 1, dtype=torch.int32),
                  state_slots=torch.tensor(slots), query_lens=qlens, context_lens=[8, 0, 8, 8], is_decode=False,
                  max_seq_len=13, num_drafts=[3, 0, 1, 0])
    ctx.verify = verify_rows(qlens, cu, slots, decoding, torch.device("cpu"))
    set_context(ctx)
    try:
        y = m(x)
    finally:
        set_context(None)
    dec_slots = [slots[b] for b in range(4) if decoding[b]]
    assert torch.equal(m.ssm_state[dec_slots], ssm0[dec_slots]) and torch.equal(m.conv_state[dec_slots], conv0[dec_slots])
    verified = (m.conv_state.clone(), m.ssm_state.clone())
    kept = m._kept
    # reference: each sequence alone, one token per call (the prompt chunk as one varlen call)
    ref = torch.empty_like(y)
    after = {}  # (b, t) -> states after row t
    for b in range(4):
        m.conv_state, m.ssm_state = conv0.clone(), ssm0.clone()
        rows = range(cu[b], cu[b + 1])
        if decoding[b]:
            for t, r in enumerate(rows):
                set_context(_step_ctx(slots[b]))
                ref[r] = m(x[r:r + 1])[0]
                after[b, t] = (m.conv_state[slots[b]].clone(), m.ssm_state[slots[b]].clone())
        else:
            c = Context(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32), seq_lens=torch.tensor([5], dtype=torch.int32),
                        slot_mapping=torch.zeros(5, dtype=torch.int64), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                        state_slots=torch.tensor([slots[b]]), query_lens=[5], context_lens=[0], is_decode=False,
                        max_seq_len=5)
            set_context(c)
            ref[cu[b]:cu[b + 1]] = m(x[cu[b]:cu[b + 1]])
            after[b, 4] = (m.conv_state[slots[b]].clone(), m.ssm_state[slots[b]].clone())
        set_context(None)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for accepted in ([0, 0], [1, 0], [2, 0], [3, 1]):
        m.conv_state, m.ssm_state = (t.clone() for t in verified)
        m._kept = kept
        acc = {0: accepted[0], 2: accepted[1], 3: 0}   # sequence 3 decoded one token, no drafts
        dec = [0, 2, 3]
        m.replay_verified(torch.tensor([cu[b] for b in dec]), torch.tensor([slots[b] for b in dec]),
                          torch.tensor([acc[b] for b in dec]), max(acc.values()) + 1, cu[-1], scratch,
                          {accepted[0]: [slots[0]]})
        for b in dec:
            torch.testing.assert_close(m.conv_state[slots[b]], after[b, acc[b]][0], rtol=1e-5, atol=1e-6)  # projections batched differently
            torch.testing.assert_close(m.ssm_state[slots[b]], after[b, acc[b]][1], rtol=1e-6, atol=1e-6)
        snap = m.snapshots[(slots[0], accepted[0])]
        assert torch.equal(snap[0], m.conv_state[slots[0]]) and torch.equal(snap[1], m.ssm_state[slots[0]])
        torch.testing.assert_close(m.conv_state[slots[1]], after[1, 4][0], rtol=1e-5, atol=1e-6)  # the prompt chunk
        torch.testing.assert_close(m.ssm_state[slots[1]], after[1, 4][1], rtol=1e-5, atol=1e-5)
        untouched = [s for s in range(S) if s not in slots and s != scratch]
        assert torch.equal(m.ssm_state[untouched], ssm0[untouched])


# ---- rejection sampling ------------------------------------------------------------------------

def _chain(V, seed, scale):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * scale  # logits of the next token given the previous one


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "topk", "topp"])
def test_rejection_sampling_preserves_the_distribution(params):
    """A Markov 'target' over 4 tokens and a very different 'drafter': sequences of 3 tokens
    generated by drafting 2 and verifying follow the target's joint distribution (64 outcomes),
    while taking the drafts as they come would not."""
    V, L, N, k = 4, 3, 6000, 2
    P, Q = _chain(V, 0, 1.5), _chain(V, 1, 1.5)
    p_of = lambda prev: torch.softmax(_filter(P[prev], params), -1)
    q_of = lambda prev: torch.softmax(Q[prev], -1)

    def joint(prob_of):  # probability of every L-token sequence under a Markov chain starting at token 0
        out = torch.zeros([V] * L)
        for idx in torch.cartesian_prod(*[torch.arange(V)] * L):
            prob, prev = 1.0, 0
            for t in idx.tolist():
                prob, prev = prob * prob_of(prev)[t].item(), t
            out[tuple(idx.tolist())] = prob
        return out
    exact, naive = joint(p_of), joint(q_of)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros([V] * L)
    for _ in range(N):
        out = []
        while len(out) < L:
            prev = out[-1] if out else 0
            drafts, probs = [], []
            for _ in range(k):
                q = q_of(prev)
                d = torch.multinomial(q, 1, generator=gen).item()
                drafts.append(d)
                probs.append(q)
                prev = d
            ctx = [out[-1] if out else 0] + drafts  # row i: the token before draft i
            out += accept(P[ctx], drafts, torch.stack(probs), params, gen)
        counts[tuple(out[:L])] += 1
    tv = 0.5 * (counts / N - exact).abs().sum().item()
    assert 0.5 * (naive - exact).abs().sum().item() > 0.25  # the test can tell the two apart
    assert tv < 0.06, tv


def test_greedy_accept_is_argmax_prefix():
    logits = torch.tensor([[0., 5, 0], [4, 0, 0], [0, 0, 3], [1, 0, 0]])
    g = SamplingParams(temperature=0)
    assert accept(logits, [1, 0, 2], None, g, None) == [1, 0, 2, 0]
    assert accept(logits, [1, 2, 2], None, g, None) == [1, 0]
    assert accept(logits, [0, 0, 2], None, g, None) == [1]


def test_sampled_speculation_through_the_engine(tmp_path):
    """Temperature 1 with the MTP drafter on a model with a peaked 8-token vocabulary: the second
    and third generated tokens (both produced by verification steps) follow the model's exact
    marginals, computed by enumeration with teacher forcing."""
    path = str(tmp_path / "q")
    make_checkpoint(path, "qwen3_5_text", vocab_size=8)
    add_mtp(path, std=0.2)
    from safetensors.torch import load_file, save_file
    import os
    w = load_file(os.path.join(path, "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] * 25  # peaked next-token distributions
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    prompt = [3, 1, 4, 1, 5]
    base = _llm(path)
    firsts = list(range(8))
    lp1 = base.teacher_force([prompt], [[0]])[0][0].exp()
    lp2 = torch.stack([r[1] for r in base.teacher_force([prompt] * 8, [[a, 0] for a in firsts])]).exp()
    pairs = [(a, b) for a in firsts for b in firsts]
    lp3 = torch.stack([r[2] for r in base.teacher_force([prompt] * 64, [[a, b, 0] for a, b in pairs])]).exp()
    m2 = (lp1[:, None] * lp2).sum(0)
    m3 = sum(lp1[a] * lp2[a, b] * lp3[i] for i, (a, b) in enumerate(pairs))
    llm = _llm(path, num_speculative_tokens=2, max_num_seqs=64)
    N = 1200
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(N)]
    outs = llm.generate(prompt_token_ids=[prompt] * N, sampling_params=sps)
    toks = torch.tensor([o.token_ids for o in outs])
    assert llm.engine.runner.spec.metrics()["spec_verifications"] >= N
    for col, exact in ((1, m2), (2, m3)):
        freq = torch.bincount(toks[:, col], minlength=8).float() / N
        assert 0.5 * (freq - exact).abs().sum() < 0.06, (col, freq, exact)


def test_gdn_snapshots_inside_verified_runs_serve_prefix_hits(mtp_ckpt, monkeypatch):
    """A snapshot point passed in the middle of an accepted run is saved from the kept per-position
    state; a later request resuming from it decodes as without the cache."""
    from sketchkv.engine.speculative import Speculator
    kept = []
    orig = Speculator.slot_states
    monkeypatch.setattr(Speculator, "slot_states", lambda self, slot, t: kept.append(t) or orig(self, slot, t))
    prompt = _prompts((21,), 9)[0]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = _llm(mtp_ckpt).generate(prompt_token_ids=[prompt], sampling_params=sp)[0].token_ids
    llm = _llm(mtp_ckpt, num_speculative_tokens=7, snapshot_interval_blocks=1)
    assert _run_with_oracle(llm, [prompt], sp, {tuple(prompt): prompt + full}) == [full]
    assert kept  # at least one boundary fell inside a verified run
    follow = prompt + full[:35]
    ref = _llm(mtp_ckpt, enable_prefix_caching=False).generate(prompt_token_ids=[follow], sampling_params=sp)[0]
    before = llm.engine.scheduler.prefix_hits
    got = _run_with_oracle(llm, [follow], sp, {tuple(follow): follow + ref.token_ids})
    assert got == [ref.token_ids]
    assert llm.engine.scheduler.prefix_hits - before == 48  # 3 blocks: two snapshots saved during decode


def test_windowed_drafter_changes_acceptance_not_tokens(mtp_ckpt):
    """mtp_attention_window: the drafter attends to 64 sinks + the last W tokens. Output identical to plain
    decoding whatever W; with W covering every context its drafts are the dense drafter's."""
    prompts = _prompts((200, 77, 140, 300), 5)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in _llm(mtp_ckpt).generate(prompt_token_ids=prompts, sampling_params=sp)]
    stats = {}
    for window in (0, 16, 4096):
        llm = _llm(mtp_ckpt, num_speculative_tokens=3, mtp_attention_window=window)
        if window:
            from sketchkv.layers.windowed_attention import WindowedAttention
            assert all(isinstance(m, WindowedAttention) for m in llm.engine.runner.mtp_attn_layers)
        assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)] == ref
        m = llm.speculative_metrics()
        stats[window] = (m["spec_verifications"], m["spec_accepted_tokens"])
    assert stats[4096] == stats[0]
    with pytest.raises(RequestError, match="mtp_attention_window"):
        _llm(mtp_ckpt, num_speculative_tokens=3, mtp_attention_window=-1)


def test_prefix_hit_restores_the_windowed_drafters_ring(mtp_ckpt):
    """The windowed drafter's K/V ring is per-slot state: a follow-up turn that starts from a cached prefix
    restores it with the GDN snapshot (taken after the step's catch-up), so its drafter sees the same K/V as
    a run that prefilled the whole conversation. One state slot: the conversation in between overwrites it."""
    prompt = _prompts((100,), 11)[0]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm = _llm(mtp_ckpt, num_speculative_tokens=3, max_num_seqs=1)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].token_ids
    llm.generate(prompt_token_ids=_prompts((150,), 12), sampling_params=sp)
    follow = prompt + first + _prompts((20,), 13)[0]
    hits = llm.engine.scheduler.prefix_hits
    llm.generate(prompt_token_ids=[follow], sampling_params=one)
    assert llm.engine.scheduler.prefix_hits - hits >= 96
    fresh = _llm(mtp_ckpt, num_speculative_tokens=3, max_num_seqs=1, enable_prefix_caching=False)
    fresh.generate(prompt_token_ids=[follow], sampling_params=one)
    got, ref = llm.engine.runner.mtp_ring_layers[0], fresh.engine.runner.mtp_ring_layers[0]
    rows = got.rows(torch.tensor(0), torch.arange(len(follow)))
    for a, b in ((got.k_cache, ref.k_cache), (got.v_cache, ref.v_cache)):
        assert b[rows].abs().amin(-1).amin(-1).gt(0).all()   # every position written
        torch.testing.assert_close(a[rows], b[rows], atol=1e-4, rtol=1e-4)


def test_windowed_drafter_memory_does_not_grow_with_context(mtp_ckpt):
    """Its K/V: sinks + a ring of W + n + 1 rows (rounded up to blocks) per state slot, not per token."""
    runner = _llm(mtp_ckpt, num_speculative_tokens=3, mtp_attention_window=40).engine.runner
    dense = _llm(mtp_ckpt, num_speculative_tokens=3, mtp_attention_window=0).engine.runner
    ring = runner.mtp_ring_layers[0]
    assert (ring.sinks, ring.width) == (64, 112)   # 64 + 40 + 3 + 1 = 108 -> 7 blocks of 16
    c = runner.model_cfg
    row = 2 * c.num_kv_heads * c.head_dim * 4   # K + V, float32
    assert runner.spec.bytes_per_seq(10_000)["mtp_kv"] == runner.spec.bytes_per_seq(100)["mtp_kv"] == 112 * row
    assert dense.spec.bytes_per_seq(10_000)["mtp_kv"] == 10_000 * row
    assert dense.kv_bytes_per_block - runner.kv_bytes_per_block == 16 * row
    assert runner.state_bytes_per_seq - dense.state_bytes_per_seq == 112 * row
