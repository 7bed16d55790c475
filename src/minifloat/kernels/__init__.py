"""Fast paths. Each kernel has a readable reference (`minifloat.quantize`) it must equal
bit for bit; where no fast kernel applies (another device, a build that failed), the
reference runs.

``MINIFLOAT_KERNELS=reference`` forces the reference everywhere (for debugging)."""

from __future__ import annotations

import os

import torch

from minifloat.quantize import dequantize_reference, quantize_reference


def _use_fast() -> bool:
    return os.environ.get("MINIFLOAT_KERNELS", "auto") != "reference"


def quantize_impl(x: torch.Tensor):
    """The quantizer for `x`: the compiled CPU kernel when available, else the reference."""
    from minifloat.kernels import cpu

    return cpu.quantize if _use_fast() and cpu.supports(x) else quantize_reference


def dequantize_impl(q):
    from minifloat.kernels import cpu

    return cpu.dequantize if _use_fast() and cpu.runs_on(q.device) else dequantize_reference


def amax(x: torch.Tensor, *, ignore_nan: bool = False) -> torch.Tensor:
    """Largest finite |x| as a float32 scalar (`minifloat.scaling.finite_amax`, fused on CPU)."""
    from minifloat.kernels import cpu
    from minifloat.scaling import finite_amax

    if _use_fast() and cpu.supports(x):
        return cpu.tensor_amax(x, ignore_nan=ignore_nan)
    return finite_amax(x, ignore_nan=ignore_nan)


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``, by the CPU transpose kernel for a transposed matrix (``m.t()``)."""
    from minifloat.kernels import cpu

    return cpu.contiguous(x) if _use_fast() and cpu.supports(x) else x.contiguous()


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """`minifloat.hadamard.rht_reference` of a contiguous float32 `x`; the CPU kernel for 16."""
    from minifloat.hadamard import rht_reference
    from minifloat.kernels import cpu

    if _use_fast() and signs.numel() == 16 and x.dtype == torch.float32 and cpu.supports(x):
        return cpu.rht16(x, signs)
    return rht_reference(x, signs)
