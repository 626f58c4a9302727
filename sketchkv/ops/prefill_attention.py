"""Prefill attention with a cached prefix: Lq new queries over Lk = prefix + Lq keys.

Query i sits at absolute position Lk - Lq + i and sees keys 0 .. Lk - Lq + i. Layout is token-major
like the KV cache: q [Lq, Hq, D], k / v [Lk, Hkv, D], GQA with query head h -> kv head h // (Hq // Hkv).

Fast path: SDPA's fused aten ops. With a prefix we never build an Lq x Lk mask: (queries vs prefix
keys, no mask) and (queries vs new keys, causal; square so top-left == bottom-right) are two calls
whose outputs are merged with their log-sum-exps. backend (EngineConfig.prefill_attention): "cudnn"
(the default) or "flash" (FlashAttention-2). H200 run 19, 27B shape, 16K-token chunks: the same speed
without a prefix (4.6 ms), cuDNN 2.0x flash after a 64K-229K prefix (147 vs 300 ms at 229K, 650 vs 319
TFLOP/s; benchmarks/bench_prefill_attention.py). A shape cuDNN refuses falls back to flash with one
warning.
"""
import warnings

import torch
import torch.nn.functional as F

BACKENDS = ("flash", "cudnn")


def prefix_causal_attention_ref(q, k, v, scale, chunk=1024):
    """fp32 reference, output [Lq, Hq, D] in q.dtype. Queries in chunks to bound the score memory."""
    Lq, Hq, D = q.shape
    Lk, Hkv, _ = k.shape
    assert Lk >= Lq and Hq % Hkv == 0
    G = Hq // Hkv
    kf, vf = k.float(), v.float()
    out = torch.empty(Lq, Hq, D, dtype=q.dtype, device=q.device)
    key_pos = torch.arange(Lk, device=q.device)
    for i in range(0, Lq, chunk):
        qc = q[i:i + chunk].float().view(-1, Hkv, G, D)
        s = torch.einsum("qhgd,khd->hgqk", qc, kf) * scale
        pos = Lk - Lq + i + torch.arange(qc.shape[0], device=q.device)
        s.masked_fill_(key_pos[None, :] > pos[:, None], float("-inf"))
        o = torch.einsum("hgqk,khd->qhgd", s.softmax(-1), vf)
        out[i:i + chunk] = o.reshape(-1, Hq, D).to(q.dtype)
    return out


def _flash(q, k, v, causal, scale):
    """q [1, Hq, L, D], k / v [1, Hkv, Lk, D] -> (out [1, Hq, L, D] in q.dtype, lse [1, Hq, L] fp32, ln)."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return r[0], r[1][..., : q.shape[2]]


def _cudnn(q, k, v, causal, scale):
    """As _flash, through cuDNN's fused attention (CUDA only)."""
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1].reshape(q.shape[0], q.shape[1], -1)[..., : q.shape[2]]


_cudnn_refused: dict = {}  # (heads, kv heads, head dim, dtype, causal) -> cuDNN's message: flash from then on


def _attend(q, k, v, causal, scale, backend):
    """(out, lse) of one call through the chosen backend. A shape cuDNN refuses is remembered (warned once)
    and goes to flash from then on, so later prefill chunks do not pay a failed plan build each."""
    key = (q.shape[1], k.shape[1], q.shape[3], q.dtype, causal)
    if backend == "cudnn" and q.is_cuda and key not in _cudnn_refused:
        try:
            return _cudnn(q, k, v, causal, scale)
        except RuntimeError as e:
            _cudnn_refused[key] = str(e).split("\n")[0][:200]
            warnings.warn(f"cuDNN attention refused q {tuple(q.shape)}, k {tuple(k.shape)}: {_cudnn_refused[key]}; "
                          "using flash for this shape")
    return _flash(q, k, v, causal, scale)


def _masked_attention(q, k, v, scale):
    """Fallback for inputs flash can't take: SDPA with an explicit mask, queries in chunks so the
    mask and any materialised fp32 scores stay under ~1 GB."""
    Lq, Hq, _ = q.shape
    Lk = k.shape[0]
    chunk = max(1, (1 << 30) // (Hq * Lk * 4))
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    key_pos = torch.arange(Lk, device=q.device)
    out = torch.empty_like(q)
    for i in range(0, Lq, chunk):
        qc = q[i:i + chunk]
        pos = Lk - Lq + i + torch.arange(qc.shape[0], device=q.device)
        mask = key_pos[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(qc.transpose(0, 1), kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        out[i:i + chunk] = o.transpose(0, 1)
    return out


def prefix_causal_attention(q, k, v, scale, backend: str = "cudnn"):
    """q [Lq, Hq, D], k / v [Lk, Hkv, D] (Lk >= Lq) -> out [Lq, Hq, D] contiguous, q.dtype. backend: "flash"
    or "cudnn" (CUDA; the CPU always runs PyTorch's CPU flash kernel)."""
    if backend not in BACKENDS:
        raise ValueError(f"prefill attention backend must be one of {BACKENDS}, got {backend!r}")
    Lq, Hq, D = q.shape
    Lk, Hkv, _ = k.shape
    assert Lk >= Lq and Hq % Hkv == 0 and k.shape == v.shape
    if Lq == 0:
        return q.new_empty(q.shape)
    flash_ok = (q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256) if q.is_cuda else True
    if not flash_ok:
        return _masked_attention(q, k, v, scale)
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D] views; flash wants only the last dim contiguous
    kt = k.transpose(0, 1).unsqueeze(0)
    vt = v.transpose(0, 1).unsqueeze(0)
    P = Lk - Lq
    if P == 0 and (backend == "flash" or not q.is_cuda):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=Hq != Hkv)
        return o[0].transpose(0, 1).contiguous()
    if P == 0:
        return _attend(qt, kt, vt, True, scale, backend)[0][0].transpose(0, 1).contiguous()
    o1, l1 = _attend(qt, kt[:, :, :P], vt[:, :, :P], False, scale, backend)  # every prefix key visible to every query
    o2, l2 = _attend(qt, kt[:, :, P:], vt[:, :, P:], True, scale, backend)   # new keys: square causal
    lse = torch.logaddexp(l1, l2)
    o = o1.float() * (l1 - lse).exp_().unsqueeze(-1)
    o.addcmul_(o2.float(), (l2 - lse).exp_().unsqueeze(-1))
    return o[0].transpose(0, 1).to(q.dtype).contiguous()
