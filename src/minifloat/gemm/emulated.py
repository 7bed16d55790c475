"""The emulated backend: the operands exactly as the hardware sees them — codes × scales,
dequantized to float32 — multiplied with a float32 GEMM (FP32 accumulation), and the helpers
that keep torch.autocast from rounding them."""

from __future__ import annotations

import contextlib
import math

import torch


def operand_values(q, transposed: bool = False) -> torch.Tensor:
    """The float32 (M,K) matrix a quantized operand stands for; `transposed` when `q` holds
    its transpose (only for tensor-scaled or square-block schemes, whose values do not depend
    on the orientation). A "dequantize" range for the profiler (`minifloat validate`)."""
    with torch.profiler.record_function("dequantize"):
        v = q.dequantize(torch.float32)
    v = v.reshape(math.prod(v.shape[:-1]), v.shape[-1])  # not -1: K may be 0 (an empty batch's grad_weight)
    return v.t() if transposed else v


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype torch.autocast runs GEMMs in on `device` here, or None when it is off."""
    try:
        on = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return None
    return torch.get_autocast_dtype(device.type) if on else None


def without_autocast(device: torch.device):
    """torch.autocast off on `device`: its BF16/FP16 would round what the emulated GEMMs
    compute in FP32 (the matmul of the dequantized operands)."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)
