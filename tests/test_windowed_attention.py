"""The windowed MTP drafter's attention over its per-slot K/V ring, against attention over the full history:
with the PyTorch references here, with the Triton kernels (selection, indexed decode) in the TRITON_INTERPRET=1
child (test_interp_*), on the GPU through tests/test_gpu_speculative.py (the default drafter)."""
import pytest
import torch

import sketchkv.ops.paged_attention as pa
from conftest import run_interpreter_tests

from sketchkv.engine.context import Context, forward_context
from sketchkv.layers.attention import Attention
from sketchkv.layers.windowed_attention import WindowedAttention

S, W, DRAFTS, BS = 4, 8, 2, 16   # ring: 8 + 2 + 1 -> one block of 16 rows per slot with the sinks, 12 in the ring
HQ, HKV, D = 4, 2, 16


def _reference(q, hist_k, hist_v, keys, scale):
    """q [Hq, D] at one position over the history rows `keys` of its sequence (fp32)."""
    k, v = hist_k[keys].float(), hist_v[keys].float()          # [N, Hkv, D]
    G = HQ // HKV
    out = torch.empty(HQ, D)
    for h in range(HKV):
        p = torch.softmax(q[h * G:(h + 1) * G].float() @ k[:, h].T * scale, -1)
        out[h * G:(h + 1) * G] = p @ v[:, h]
    return out


def _keys(pos: int, chunk_start: int | None) -> list[int]:
    sinks = list(range(min(S, pos + 1)))
    if chunk_start is None:   # decode row: the last W tokens
        return sorted(set(sinks) | set(range(max(S, pos + 1 - W), pos + 1)))
    return sorted(set(sinks) | set(range(min(chunk_start, max(S, chunk_start + 1 - W)), pos + 1)))


def test_ring_matches_windowed_attention_over_the_full_history():
    check_ring()


@pytest.mark.skipif(not pa._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_interpreter_child)")
def test_interp_ring_matches_windowed_attention_over_the_full_history():
    check_ring()


def test_interpreter_child():
    run_interpreter_tests(__file__, pa._INTERPRETED)


def check_ring():
    """Two sequences in slots 0 and 2, prompt chunks longer than the ring (it wraps), decode rows, a
    verification's draft rows and their rejection (rows rewritten): every output row equals attention over
    the whole history restricted to its window."""
    torch.manual_seed(0)
    layer = WindowedAttention(Attention(HQ, HKV, D, D ** -0.5), S, W, DRAFTS, BS)
    assert (layer.width, layer.ring) == (16, 12)
    layer.allocate_ring(3, torch.float32, "cpu")
    hist = {s: (torch.zeros(200, HKV, D), torch.zeros(200, HKV, D)) for s in (0, 2)}
    length = {0: 0, 2: 0}

    def step(spec):
        """spec: per sequence (slot, kind, number of rows); kind "prompt" or "decode" (rows at length, length + 1, ...)."""
        qlens = [n for _, _, n in spec]
        cached = [length[s] for s, _, _ in spec]
        T = sum(qlens)
        q, k, v = torch.randn(T, HQ, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
        cu = [0]
        for n in qlens:
            cu.append(cu[-1] + n)
        is_decode = all(kind == "decode" and n == 1 for _, kind, n in spec)
        ctx = Context(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                      seq_lens=torch.tensor([c + n for c, n in zip(cached, qlens)], dtype=torch.int32),
                      slot_mapping=torch.zeros(T, dtype=torch.int64), block_tables=torch.zeros(len(spec), 1, dtype=torch.int32),
                      state_slots=torch.tensor([s for s, _, _ in spec]), query_lens=qlens, context_lens=cached,
                      is_decode=is_decode, max_seq_len=max(c + n for c, n in zip(cached, qlens)))
        ctx.num_drafts = [n - 1 if kind == "decode" else 0 for _, kind, n in spec]
        dec = [b for b, (_, kind, _) in enumerate(spec) if kind == "decode"]
        if dec and not is_decode:
            ctx.decode_rows = torch.tensor([cu[b] + i for b in dec for i in range(qlens[b])])
            ctx.decode_seqs = torch.tensor([b for b in dec for _ in range(qlens[b])])
            ctx.decode_lens = torch.tensor([cached[b] + i + 1 for b in dec for i in range(qlens[b])], dtype=torch.int32)
        with forward_context(ctx):
            out = layer(q, k, v)
        for b, (s, kind, n) in enumerate(spec):
            hk, hv = hist[s]
            hk[cached[b]:cached[b] + n], hv[cached[b]:cached[b] + n] = k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]]
            for i in range(n):
                pos = cached[b] + i
                want = _reference(q[cu[b] + i], hk, hv, _keys(pos, cached[b] if kind == "prompt" else None), layer.scale)
                torch.testing.assert_close(out[cu[b] + i], want, atol=1e-5, rtol=1e-5)
            length[s] += n

    step([(0, "prompt", 10)])
    step([(0, "prompt", 20), (2, "prompt", 5)])     # 20 rows > the ring's 12: the chunk keeps its last 12
    step([(0, "decode", 1), (2, "decode", 1)])
    step([(0, "decode", 3), (2, "prompt", 20)])     # token + 2 drafts (positions 31-33)
    length[0] -= 2                                  # both drafts rejected: 32 and 33 are written again
    step([(0, "decode", 3), (2, "decode", 1)])
    for _ in range(15):                             # the ring wraps again
        step([(0, "decode", 1), (2, "decode", 1)])
    assert length == {0: 50, 2: 42}
