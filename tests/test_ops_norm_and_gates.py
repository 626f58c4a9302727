"""Fused RMSNorm and Gated DeltaNet gate kernels against their references (interpreter on CPU, real sizes on the GPU)."""

import pytest
import torch

from sketchkv.ops import paged_attention as pa
from sketchkv.ops.rmsnorm import GATED, PLAIN, ZERO_CENTERED, rms_norm, rms_norm_ref
from conftest import run_interpreter_tests

needs_interp = pytest.mark.skipif(not pa._INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


def test_reference_matches_transformers_norms():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated
    x, g = torch.randn(7, 64, dtype=torch.bfloat16), torch.randn(7, 64, dtype=torch.bfloat16)
    for kind, mod in ((ZERO_CENTERED, Qwen3NextRMSNorm(64)), (PLAIN, LlamaRMSNorm(64)), (GATED, Qwen3NextRMSNormGated(64))):
        with torch.no_grad():
            mod.weight.normal_()
            mod.to(torch.bfloat16 if kind != ZERO_CENTERED else torch.float32)
            ref = mod(x, g) if kind == GATED else mod(x)
        assert torch.equal(rms_norm_ref(x, mod.weight, 1e-6, kind, g), ref)


@needs_interp
@pytest.mark.parametrize("kind", [ZERO_CENTERED, PLAIN, GATED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_kernel_matches_reference(kind, dtype):
    torch.manual_seed(kind)  # random data, reproducible: bf16 truncation in the interpreter sits near the bound
    x = torch.randn(5, 3, 96, dtype=dtype) * 3
    g = torch.randn(5, 3, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)
    out = rms_norm(x, w, 1e-6, kind, g)
    ref = rms_norm_ref(x, w, 1e-6, kind, g)
    # bf16: the interpreter emulates bf16 casts by truncation (twice for the plain and gated kinds),
    # so allow three bf16 steps (at most 3 x 2^-7 relative)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2.4e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)


@needs_interp
def test_interp_gated_kernel_reads_a_strided_gate_in_place():
    """The GDN output gate z is a [T, Hv, Dv] view of in_proj's output (rows padded by q/k/v/b/a columns): the
    kernel reads it in place (no copy) and gives what it gives on a contiguous copy."""
    from sketchkv.ops.rmsnorm import _head_rows
    torch.manual_seed(3)
    T, H, D = 4, 3, 32
    fused = torch.randn(T, 40 + H * D + 8)
    z = fused[:, 40:40 + H * D].unflatten(-1, (H, D))
    g, st, sh, gh = _head_rows(z, D)
    assert g.data_ptr() == z.data_ptr() and (st, sh, gh) == (fused.stride(0), D, H)
    x, w = torch.randn(T * H, D) * 3, torch.randn(D)
    out = rms_norm(x.view(T, H, D), w, 1e-6, GATED, z)
    torch.testing.assert_close(out, rms_norm(x.view(T, H, D), w, 1e-6, GATED, z.contiguous()), rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_ref(x.view(T, H, D), w, 1e-6, GATED, z), rtol=1e-5, atol=1e-5)


@needs_interp
@pytest.mark.parametrize("kind", [ZERO_CENTERED, PLAIN])
def test_interp_kernel_reads_strided_head_rows_in_place(kind):
    """Attention's q and k norms: [T, H, D] views of the fused qkv output (q also interleaved with its gate) are
    read in place, row (t, h) by its two strides, and normed as their contiguous copies are."""
    torch.manual_seed(4)
    T, H, Hkv, D = 5, 3, 2, 32
    qkv = torch.randn(T, 2 * H * D + 2 * Hkv * D) * 3
    qg, k, _ = qkv.split([2 * H * D, Hkv * D, Hkv * D], dim=-1)
    q = qg.view(T, H, 2 * D).chunk(2, dim=-1)[0]
    w = torch.randn(D)
    for x in (q, k.view(T, Hkv, D)):
        assert not x.is_contiguous()
        out = rms_norm(x, w, 1e-6, kind)
        assert out.shape == x.shape
        torch.testing.assert_close(out, rms_norm(x.contiguous(), w, 1e-6, kind), rtol=0, atol=0)
        torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6, kind), rtol=1e-5, atol=1e-5)


@needs_interp
@pytest.mark.parametrize("kind", [ZERO_CENTERED, PLAIN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_residual_kernel_matches_reference(kind, dtype):
    torch.manual_seed(10 + kind)
    x, r = torch.randn(6, 96, dtype=dtype) * 3, torch.randn(6, 96, dtype=dtype) * 3
    w = torch.randn(96, dtype=dtype)
    out, s = rms_norm(x, w, 1e-6, kind, residual=r)
    ref, ref_s = rms_norm_ref(x, w, 1e-6, kind, residual=r)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2.4e-2, atol=1e-2)
    torch.testing.assert_close(s, ref_s, **tol)
    torch.testing.assert_close(out, ref, **tol)


def test_residual_reference_is_add_then_norm():
    x, r, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64)
    out, s = rms_norm_ref(x, w, 1e-6, ZERO_CENTERED, residual=r)
    assert torch.equal(s, x + r) and torch.equal(out, rms_norm_ref(x + r, w, 1e-6, ZERO_CENTERED))


def _rotary_inputs(dtype, device="cpu", T=5, D=32, rd=16):
    from sketchkv.layers.rotary import RotaryEmbedding
    rot = RotaryEmbedding(D, rd, 10000.0).to(device)
    pos = torch.randint(0, 300_000, (T,), device=device)       # large angles: cos / sin come from torch
    q = torch.randn(T, 6, 2 * D, dtype=dtype, device=device)[..., :D]   # a strided view, as after a split
    k = torch.randn(T, 2, D, dtype=dtype, device=device)
    return rot, pos, q, k


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rd", [16, 32])
def test_interp_rotary_kernel_matches_reference(dtype, rd):
    from sketchkv.ops.rotary import apply_rotary, apply_rotary_ref
    torch.manual_seed(rd)
    rot, pos, q, k = _rotary_inputs(dtype, rd=rd)
    cos, sin = rot.cos_sin(pos)
    qo, ko = apply_rotary(q, k, cos, sin, rd)
    if dtype == torch.bfloat16:   # every rounding is done by integer arithmetic: bitwise, even interpreted
        assert torch.equal(qo, apply_rotary_ref(q, cos, sin, rd)) and torch.equal(ko, apply_rotary_ref(k, cos, sin, rd))
    torch.testing.assert_close(qo, apply_rotary_ref(q, cos, sin, rd), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, apply_rotary_ref(k, cos, sin, rd), rtol=1e-5, atol=1e-5)
    assert torch.equal(qo[..., rd:], q[..., rd:])              # the pass-through dims are copied
    only_q, none = apply_rotary(q, None, cos, sin, rd)
    assert none is None and torch.equal(only_q, qo)


def test_rotary_reference_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb   # partial rotary
    from sketchkv.ops.rotary import apply_rotary_ref
    rot, pos, q, k = _rotary_inputs(torch.bfloat16, rd=16)
    cos, sin = rot.cos_sin(pos)
    # transformers' rotary module hands cos / sin over in the activation dtype
    qt, kt = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None].bfloat16(),
                                  sin[None].bfloat16())
    assert torch.equal(apply_rotary_ref(q, cos, sin, 16), qt[0].transpose(0, 1))
    assert torch.equal(apply_rotary_ref(k, cos, sin, 16), kt[0].transpose(0, 1))


def test_rotary_cos_sin_computed_once_per_forward():
    from sketchkv.engine.context import Context, forward_context
    rot, pos, _, _ = _rotary_inputs(torch.float32)
    other, _, _, _ = _rotary_inputs(torch.float32)          # a second layer, same config
    ctx = Context(*([None] * 7), is_decode=True, max_seq_len=0)
    with forward_context(ctx):
        c1, _ = rot.cos_sin(pos)
        c2, _ = other.cos_sin(pos)
        c3, _ = rot.cos_sin(pos.clone())                     # other positions: computed again
    assert c1 is c2 and c3 is not c1 and torch.equal(c3, c1)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_silu_and_mul_matches_reference(dtype):
    from sketchkv.ops.silu_and_mul import silu_and_mul, silu_and_mul_ref
    torch.manual_seed(5)
    x = torch.randn(3, 2, 2 * 1100, dtype=dtype) * 4       # I = 1100: two column tiles, the second partial
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2.4e-2, atol=1e-2)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **tol)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_sigmoid_gate_matches_reference(dtype):
    """Gated attention's output gate with the gate a strided view of the q projection (as the model takes it)."""
    from sketchkv.ops.sigmoid_gate import sigmoid_gate, sigmoid_gate_ref
    torch.manual_seed(6)
    qg = torch.randn(3, 4, 2 * 64, dtype=dtype) * 4
    q, gate = qg.chunk(2, dim=-1)
    o = torch.randn(3, 4, 64, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(sigmoid_gate(o, gate), sigmoid_gate_ref(o, gate), **tol)


def test_interpreter_child():
    run_interpreter_tests(__file__, pa._INTERPRETED)



@pytest.mark.gpu
@pytest.mark.parametrize("kind", [ZERO_CENTERED, PLAIN, GATED])
def test_gpu_kernel_matches_reference(kind):
    x = torch.randn(64, 5120, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    w = torch.randn(5120, device="cuda", dtype=torch.bfloat16)
    out = rms_norm(x, w, 1e-6, kind, g)
    ref = rms_norm_ref(x, w, 1e-6, kind, g)
    # same roundings; only the fp32 reduction order differs -> at most one bf16 ulp here and there
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 1.6e-2 + 1e-3).all()


@pytest.mark.gpu
def test_gpu_fused_elementwise_kernels_match_torch():
    """Residual RMSNorm, RoPE and silu_and_mul at the 27B shape against the torch ops they replace."""
    from sketchkv.ops.rotary import apply_rotary, apply_rotary_ref
    from sketchkv.ops.silu_and_mul import silu_and_mul, silu_and_mul_ref
    x, r = torch.randn(64, 5120, device="cuda", dtype=torch.bfloat16), torch.randn(64, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5120, device="cuda", dtype=torch.bfloat16)
    out, s = rms_norm(x, w, 1e-6, ZERO_CENTERED, residual=r)
    ref, ref_s = rms_norm_ref(x, w, 1e-6, ZERO_CENTERED, residual=r)
    assert torch.equal(s, ref_s)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 1.6e-2 + 1e-3).all()
    rot, pos, q, k = _rotary_inputs(torch.bfloat16, "cuda", T=64, D=256, rd=64)
    cos, sin = rot.cos_sin(pos)
    qo, ko = apply_rotary(q, k, cos, sin, 64)
    assert torch.equal(qo, apply_rotary_ref(q, cos, sin, 64)) and torch.equal(ko, apply_rotary_ref(k, cos, sin, 64))
    h = torch.randn(64, 2 * 17408, device="cuda", dtype=torch.bfloat16) * 3
    got, want = silu_and_mul(h), silu_and_mul_ref(h)
    # exp differs in the last fp32 bits from torch's: at most one bf16 step in the product here and there
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 1.6e-2 + 1e-6).all()
    assert (got != want).float().mean() < 0.01


# ---- Gated DeltaNet gates (same file: small elementwise kernels of the decode step) ----------------

def test_gdn_gates_reference_matches_transformers_formula():
    from sketchkv.ops.gdn_gates import gdn_gates_ref
    a, b = torch.randn(9, 6, dtype=torch.bfloat16) * 4, torch.randn(9, 6, dtype=torch.bfloat16)
    A_log, dt = torch.rand(6).log(), torch.rand(6)
    g, beta = gdn_gates_ref(a, b, A_log, dt)
    assert torch.equal(beta, b.sigmoid())
    assert torch.allclose(g, -A_log.exp() * torch.nn.functional.softplus(a.float() + dt))


@needs_interp
def test_interp_gdn_gates_kernel_matches_reference():
    from sketchkv.ops.gdn_gates import gdn_gates, gdn_gates_ref
    torch.manual_seed(3)
    a = torch.randn(7, 48) * 12          # both sides of softplus's threshold
    b = torch.randn(7, 48)
    A_log, dt = torch.rand(48).log(), torch.randn(48)
    g, beta = gdn_gates(a, b, A_log, dt)
    rg, rb = gdn_gates_ref(a, b, A_log, dt)
    torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta, rb, rtol=1e-5, atol=1e-6)
