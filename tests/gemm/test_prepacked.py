"""`minifloat.gemm.prepack`: a weight prepacked once for decode-sized products, against a float64
product of its dequantized values; remade when the weight or the kernel registry changes."""

import copy

import pytest
import torch

import minifloat
from minifloat import quantize
from minifloat.gemm import (
    DECODE_ROWS,
    prepack,
    register_weight_only_kernel,
    unregister_weight_only_kernel,
    weight_only_kernels,
)
from minifloat.kernels import gemv


def oracle(x: torch.Tensor, w) -> torch.Tensor:
    return x.double() @ w.dequantize().double().t()


def close(got: torch.Tensor, x: torch.Tensor, w) -> bool:
    """Within FP32 summation order of the float64 product (K terms, each exact in float32)."""
    bound = (x.double().abs() @ w.dequantize().double().abs().t()) * (x.shape[1] + 2) * 2.0**-24
    return bool(((got.double() - oracle(x, w)).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "fp8_rowwise", "mxfp6_e2m3"])
def test_a_prepacked_weight_equals_the_product_of_its_values(scheme):
    w = quantize(torch.randn(48, 256, generator=torch.Generator().manual_seed(1)), scheme)
    packed = prepack(w)
    for rows in (1, DECODE_ROWS, DECODE_ROWS + 1):  # the decode kernel, then the dispatch's reference
        x = torch.randn(rows, 256)
        assert packed.decodes(x) == (rows <= DECODE_ROWS)
        assert close(packed(x), x, w)


def test_the_plan_is_remade_when_the_weight_is_written_in_place():
    w = quantize(torch.randn(32, 64), "fp8_rowwise")
    packed = prepack(w)
    x = torch.randn(1, 64)
    before = packed(x)
    plan = packed.plan
    w.data[0].fill_(0x7F)  # E4M3's NaN code: the new plan must know it has NaN codes
    w.data[1].zero_()
    after = packed(x)
    assert packed.plan is not plan and torch.isnan(after[0, 0]) and after[0, 1] == 0
    assert torch.equal(after[0, 2:], before[0, 2:])


def test_a_kernel_registered_or_removed_after_prepacking_takes_effect():
    w = quantize(torch.randn(16, 64), "nvfp4")
    packed = prepack(w)
    x = torch.randn(2, 64)
    register_weight_only_kernel("test-ones", lambda x, w: True, lambda x, w: torch.ones(x.shape[0], w.shape[0]))
    try:
        assert not packed.decodes(x) and torch.equal(packed(x), torch.ones(2, 16))
    finally:
        unregister_weight_only_kernel("test-ones")
    assert weight_only_kernels() == ["decode"] and packed.decodes(x) and close(packed(x), x, w)
    with pytest.raises(minifloat.MinifloatError, match="no weight-only kernel 'test-ones' is registered"):
        unregister_weight_only_kernel("test-ones")


def test_a_copy_plans_its_own_weight():
    w = quantize(torch.randn(16, 64), "mxfp4")
    packed = prepack(w)
    twin = copy.deepcopy(packed)
    assert twin.weight is not w and twin.plan.args.data != packed.plan.args.data  # its own codes' address
    w.data.zero_()
    x = torch.randn(1, 64)
    assert torch.equal(packed(x), torch.zeros(1, 16)) and close(twin(x), x, twin.weight) and twin(x).abs().sum() > 0


def test_the_decode_rows_are_the_kernels_own():
    """gemv.MAX_ROWS is defined once and the library's MMAX agrees (checked when it loads)."""
    assert DECODE_ROWS == gemv.MAX_ROWS == gemv._library().mf_gemv_max_rows()
