import pytest
import torch

import minifloat
from minifloat.gemm import choose_backend, native_support, scaled_mm
from minifloat.recipes import RECIPES, ROLES, get_recipe

from .conftest import requires_cuda

SCHEMES = sorted({get_recipe(r).scheme(role) for r in RECIPES for role in ROLES}, key=lambda s: (s.name, str(s)))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.element}-{s.block}-{s.rounding}")
def test_emulated_gemm_equals_float64_product_of_the_dequantized_operands(scheme):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(48, 256, generator=g) * 3, torch.randn(40, 256, generator=g)
    qa = minifloat.quantize(a, scheme, generator=g)
    qb = minifloat.quantize(b, scheme, generator=g)
    da, db = qa.dequantize().double(), qb.dequantize().double()
    ref = da @ db.T
    out = scaled_mm(qa, qb)
    # FP32 accumulation of exact products: |error| ≤ K · 2^-24 · Σ|a||b| (a standard bound).
    bound = 256 * 2.0**-24 * (da.abs() @ db.abs().T)
    assert out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= bound).all()
    assert not torch.equal(da, a.double())  # it really quantized


def test_transposed_operands_of_orientation_free_schemes():
    a, b = torch.randn(64, 32), torch.randn(48, 32)
    qa_t = minifloat.quantize(a.t().contiguous(), "fp8")  # holds aᵀ
    qb = minifloat.quantize(b, "fp8")
    out = scaled_mm(qa_t, qb, a_transposed=True)
    assert torch.allclose(out, qa_t.dequantize().t() @ qb.dequantize().T, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("scheme", ["fp8", "fp8_e5m2"])
def test_native_cpu_scaled_mm_agrees_with_emulated(scheme):
    g = torch.Generator().manual_seed(1)
    qa = minifloat.quantize(torch.randn(32, 64, generator=g), scheme)
    qb = minifloat.quantize(torch.randn(16, 64, generator=g) * 100, scheme)
    native = scaled_mm(qa, qb, backend="native")
    emulated = scaled_mm(qa, qb, backend="emulated")
    assert torch.allclose(native, emulated, rtol=1e-6, atol=1e-6)


def test_backend_choice_and_errors():
    fp8, mx = minifloat.get_scheme("fp8"), minifloat.get_scheme("mxfp8")
    assert choose_backend([fp8], "cpu") == "emulated"
    assert choose_backend([fp8], "cpu", "native") == "native"
    assert "not wired" in native_support(mx, "cpu")
    with pytest.raises(minifloat.MinifloatError, match="backend='native' cannot run mxfp8 on cpu"):
        choose_backend([mx], "cpu", "native")
    with pytest.raises(minifloat.MinifloatError, match="unknown GEMM backend 'fast'"):
        choose_backend([fp8], "cpu", "fast")


@requires_cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA SM ≥ 8.9"
)
@pytest.mark.parametrize("scheme", ["fp8", "fp8_e5m2", "fp8_rowwise"])
def test_native_cuda_gemm_agrees_with_emulated(scheme):
    if scheme == "fp8_rowwise" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled FP8 GEMMs need SM ≥ 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)
    qa = minifloat.quantize(torch.randn(256, 512, device="cuda", generator=g), scheme)
    qb = minifloat.quantize(torch.randn(128, 512, device="cuda", generator=g), scheme)
    out_dtype = torch.bfloat16 if scheme == "fp8_rowwise" else torch.float32
    native = scaled_mm(qa, qb, backend="native", out_dtype=out_dtype).float()
    emulated = scaled_mm(qa, qb, backend="emulated").to(out_dtype).float()
    assert torch.allclose(native, emulated, rtol=2e-2 if out_dtype == torch.bfloat16 else 1e-5, atol=1e-3)
