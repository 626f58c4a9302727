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
