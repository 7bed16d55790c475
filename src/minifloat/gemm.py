"""Scaled GEMM on quantized operands: ``a · bᵀ`` with both quantized along K.

Two backends behind one call:

- ``emulated`` (any device): the operands exactly as the hardware sees them — codes × scales,
  dequantized to float32 — multiplied with a float32 GEMM. Products of two elements of
  ≤ 8 significant bits are exact in float32 and the sum accumulates in float32, so the result
  is that of a low-precision GEMM with FP32 accumulation (up to summation order). On CUDA,
  TF32 would round the operands; minifloat never enables it and checks that it is off.
- ``native``: ``torch._scaled_mm`` on the FP8 codes with the FP32 decode scales — cuBLASLt on
  CUDA devices of compute capability ≥ 8.9 (chosen automatically there), and PyTorch's CPU
  implementation when asked for explicitly (it is slower than ``emulated`` on a CPU).

Which formats run natively where (`native_support`): FP8 (E4M3/E5M2) with per-tensor scales
on SM ≥ 8.9, and with per-row scales on SM ≥ 9.0. MX and NVFP4 block-scaled GEMMs exist on
SM ≥ 10.0 in hardware; minifloat emulates them until it can test them on such a device.

Example:
    >>> from minifloat import quantize
    >>> a, b = torch.randn(8, 64), torch.randn(4, 64)
    >>> qa, qb = quantize(a, "mxfp8"), quantize(b, "mxfp8")
    >>> out = scaled_mm(qa, qb)
    >>> torch.allclose(out, (qa.dequantize().double() @ qb.dequantize().double().T).float(), rtol=1e-6, atol=1e-6)
    True
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.schemes import Scheme

BACKENDS = ("auto", "emulated", "native")
_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """CUDA compute capability of `device`, None for other devices."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def native_support(scheme: Scheme, device: torch.device | str) -> str | None:
    """Why `scheme` cannot run natively on `device` (None when it can, automatically).

    Example:
        >>> from minifloat.schemes import get_scheme
        >>> native_support(get_scheme("fp8"), "cpu")
        'no native low-precision GEMM on cpu (torch._scaled_mm runs there only when asked for)'
    """
    device = torch.device(device)
    if scheme.element not in _TORCH_FP8 or scheme.scale_format != "fp32" or scheme.granularity == "block":
        return f"{scheme.name}: native MX/NVFP4/block-scaled GEMMs are not wired yet (emulated)"
    cap = device_capability(device)
    if cap is None:
        return f"no native low-precision GEMM on {device.type} (torch._scaled_mm runs there only when asked for)"
    need = (9, 0) if scheme.granularity == "row" else (8, 9)
    if cap < need:
        return f"FP8 {scheme.granularity}-scaled GEMMs need compute capability ≥ {need[0]}.{need[1]}, this GPU is {cap[0]}.{cap[1]}"
    return None


def _can_force_native(scheme: Scheme, device: torch.device) -> bool:
    ok_scheme = scheme.element in _TORCH_FP8 and scheme.scale_format == "fp32" and scheme.granularity != "block"
    return ok_scheme and (device.type == "cpu" and scheme.granularity == "tensor" or device_capability(device) is not None)


def choose_backend(schemes: list[Scheme], device: torch.device | str, requested: str = "auto") -> str:
    """``"native"`` or ``"emulated"`` for GEMMs on `schemes` on `device`."""
    device = torch.device(device)
    if requested not in BACKENDS:
        raise MinifloatError(f"unknown GEMM backend {requested!r}; use one of {', '.join(BACKENDS)}")
    if requested == "emulated":
        return "emulated"
    if requested == "native":
        bad = [s.name for s in schemes if not _can_force_native(s, device)]
        if bad:
            raise MinifloatError(
                f"backend='native' cannot run {', '.join(bad)} on {device}; use backend='auto' or 'emulated'"
            )
        return "native"
    return "native" if all(native_support(s, device) is None for s in schemes) else "emulated"


def operand_values(q, transposed: bool = False) -> torch.Tensor:
    """The float32 (M,K) matrix a quantized operand stands for; `transposed` when `q` holds
    its transpose (only for tensor-scaled or square-block schemes, whose values do not depend
    on the orientation)."""
    v = q.dequantize(torch.float32)
    v = v.reshape(-1, v.shape[-1])
    return v.t() if transposed else v


def _fp8_codes(q, transposed: bool) -> torch.Tensor:
    codes = q.data.view(_TORCH_FP8[q.scheme.element]).reshape(-1, q.shape[-1])
    return codes.t().contiguous() if transposed else codes


def scaled_mm(
    a,
    b,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "emulated",
    a_transposed: bool = False,
    b_transposed: bool = False,
) -> torch.Tensor:
    """``a · bᵀ`` for quantized `a` (M,K) and `b` (N,K), both quantized along K.

    ``*_transposed``: the operand holds its transpose (see `operand_values`)."""
    if backend == "native":
        sa, sb = a.scale.reshape(-1, 1).float(), b.scale.reshape(1, -1).float()
        if a.scheme.granularity == "tensor":
            sa, sb = sa.reshape(()), sb.reshape(())
        out = torch._scaled_mm(
            _fp8_codes(a, a_transposed), _fp8_codes(b, b_transposed).t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype
        )
        return out
    if torch.backends.cuda.matmul.allow_tf32 and a.device.type == "cuda":
        raise MinifloatError(
            "torch.backends.cuda.matmul.allow_tf32 is on: TF32 would round the emulated operands; turn it off"
        )
    return (operand_values(a, a_transposed) @ operand_values(b, b_transposed).t()).to(out_dtype)
