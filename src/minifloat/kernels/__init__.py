"""Fast paths, each beside its readable reference (`minifloat.kernels.reference`), which it
equals bit for bit. Both take plain tensors and return plain tensors: the quantizers return the
parts ``(data, scale, tensor_scale)``, and `minifloat.quant` builds the `QuantizedTensor`.

The functions here pick the path: the compiled CPU kernels (`minifloat.kernels.cpu`) where
they apply — a CPU tensor of a dtype they take, a build that loaded — and the reference
everywhere else. ``MINIFLOAT_KERNELS=reference`` forces the reference (for debugging)."""

from __future__ import annotations

import os

import torch

from minifloat.kernels import cpu, reference
from minifloat.scaling.rules import finite_amax
from minifloat.scaling.schemes import Scheme


def _use_fast() -> bool:
    return os.environ.get("MINIFLOAT_KERNELS", "auto") != "reference"


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> reference.Parts:
    """``(data, scale, tensor_scale)`` of `x` under `scheme` (arguments as the reference's)."""
    fast = _use_fast() and x.numel() > 0 and cpu.supports(x) and cpu.encodes(scheme.element_format)  # empty: nothing to measure
    impl = cpu.quantize if fast else reference.quantize
    return impl(x, scheme, scale=scale, amax=amax, rounding=rounding, generator=generator)


def dequantize(data, scale, tensor_scale, shape, scheme: Scheme, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values the parts stand for, cropped to `shape`, in `dtype`."""
    fast = _use_fast() and cpu.runs_on(data.device) and cpu.encodes(scheme.element_format)
    impl = cpu.dequantize if fast else reference.dequantize
    return impl(data, scale, tensor_scale, shape, scheme, dtype)


def amax(x: torch.Tensor, *, ignore_nan: bool = False) -> torch.Tensor:
    """Largest finite |x| as a float32 scalar (`minifloat.scaling.rules.finite_amax`, fused on CPU)."""
    if _use_fast() and cpu.supports(x):
        return cpu.tensor_amax(x, ignore_nan=ignore_nan)
    return finite_amax(x, ignore_nan=ignore_nan)


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``, by the CPU transpose kernel for a transposed matrix (``m.t()``)."""
    return cpu.contiguous(x) if _use_fast() and cpu.supports(x) else x.contiguous()


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """`reference.rht` of a contiguous float32 `x`; the CPU kernel for 16-wide groups."""
    if _use_fast() and signs.numel() == 16 and x.dtype == torch.float32 and cpu.supports(x):
        return cpu.rht16(x, signs)
    return reference.rht(x, signs)
