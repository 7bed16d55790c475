"""Shared fixtures and markers. ml_dtypes is the independent oracle for element formats."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import minifloat

# ml_dtypes' type for each of our formats: the oracle, never imported by the library.
ML_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
}
FORMAT_NAMES = list(minifloat.FORMATS)

def requires_cuda(test):
    """A CUDA test: skipped without a device, selected by `make gpu-check` (``-m cuda``)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def oracle_encode(x: np.ndarray, name: str, saturate: bool) -> np.ndarray:
    """ml_dtypes' codes for `x` (a float16/bfloat16/float32 array).

    ml_dtypes has no saturating mode; the saturating oracle clips to ±max first (in float32,
    where every fp16/bf16 value and every format max are exact), which is what saturation means.
    """
    fmt = minifloat.get_format(name)
    x32 = x.astype(np.float32)
    if saturate:
        x32 = np.clip(x32, np.float32(-fmt.max), np.float32(fmt.max))
    with np.errstate(invalid="ignore", over="ignore"):
        return x32.astype(ML_DTYPES[name]).view(np.uint8)


def all_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16-bit float dtype."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def sqnr_db(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `approx` against `ref`, in float64."""
    ref, approx = ref.double(), approx.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (approx - ref).pow(2).sum()))
