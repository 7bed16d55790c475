"""`quantize`, `dequantize`, `fake_quantize`: the quantization API, the one place that builds a
`QuantizedTensor`.

They check the arguments, bring a given scale or amax to the scale grid, and hand plain
tensors to `minifloat.kernels`, which picks the fast path or the readable reference and
returns the parts ``(data, scale, tensor_scale)``. The formulas are in `minifloat.scaling`.
"""

from __future__ import annotations

import torch

from minifloat import kernels
from minifloat.errors import MinifloatError
from minifloat.formats.codec import check_float_tensor, check_rounding
from minifloat.quant.tensor import QuantizedTensor
from minifloat.scaling.layout import as_float32, layout_for, to_grid
from minifloat.scaling.schemes import Scheme, get_scheme

QUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64: convert first


def _check_scale(s: torch.Tensor) -> None:
    """A given encode scale must be positive and finite: 0 or inf would decode every value as
    NaN or 0, a negative one flips the signs. Checked where it costs no device synchronization
    (CPU tensors, Python numbers); on an accelerator the caller's rule (`scale_from_amax`) holds."""
    if s.device.type != "cpu":
        return
    bad = ~((s > 0) & torch.isfinite(s))
    if bool(bad.any()):
        v = s[bad][0].item()
        raise MinifloatError(
            f"scale is an encode multiplier (max / amax), positive and finite; got {v}"
            + ("" if s.numel() == 1 else f" among the {s.numel()} given")
            + " (derive it with minifloat.scale_from_amax, which keeps the previous scale for a zero or non-finite amax)"
        )


def quantize(
    x: torch.Tensor,
    scheme: str | Scheme,
    *,
    scale: torch.Tensor | float | None = None,
    amax: torch.Tensor | float | None = None,
    rounding: str | None = None,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Quantize `x` with `scheme` (a preset name or a `Scheme`) into a `QuantizedTensor`.

    Args:
        scale: FP32-scaled schemes: the encode multiplier(s) to use (a scalar, or one per
            block), skipping the amax pass — the delayed-scaling path.
        amax: the amax to derive the scale from instead of measuring it (FP32 schemes: a
            scalar or one per block; NVFP4: the tensor amax).
        rounding: override the scheme's element rounding (``"nearest"``/``"stochastic"``).
        generator: random source for stochastic rounding.

    Example:
        >>> q = quantize(torch.randn(4, 64), "mxfp4")
        >>> q.bits_per_element, q.shape
        (4.25, torch.Size([4, 64]))
    """
    scheme = get_scheme(scheme)
    check_float_tensor(x, "quantize", QUANTIZE_DTYPES)
    rounding = check_rounding(rounding or scheme.rounding)
    if x.device.type == "meta":
        raise MinifloatError("quantize needs a tensor with data, got one on the meta device; materialize it first")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise MinifloatError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if scale is not None and amax is not None:
        raise MinifloatError("pass scale or amax, not both")
    if scale is not None and scheme.scale_format != "fp32":
        raise MinifloatError(
            f"scale= is for FP32-scaled schemes; {scheme.name} derives its {scheme.scale_format} "
            f"scales from each block" + (" (pass amax= for the NVFP4 tensor amax)" if scheme.is_nvfp4 else "")
        )
    if amax is not None and scheme.is_mx:
        raise MinifloatError(f"amax= does not apply to {scheme.name}: MX scales come from each block's amax")
    if scale is not None:
        _check_scale(as_float32(scale, "scale"))
    a = None if amax is None else as_float32(amax, "amax")
    if a is not None and a.device.type == "cpu" and bool((a < 0).any()):  # no device sync, as _check_scale
        raise MinifloatError(f"amax is a largest magnitude, ≥ 0; got {amax!r} (pass abs(x).max(), not x.max())")
    if a is not None and scheme.is_nvfp4 and a.numel() != 1:
        raise MinifloatError(
            f"amax= for {scheme.name} is the tensor amax, one value; got shape {tuple(a.shape)} "
            f"(the block scales come from each block's amax)"
        )
    lay = layout_for(x.shape, scheme)
    if scale is not None:
        scale = to_grid(scale, lay, "scale")
    if a is not None:
        a = a.reshape(()) if scheme.is_nvfp4 else to_grid(a, lay, "amax")
    data, scale, tensor_scale = kernels.quantize(x, scheme, scale=scale, amax=a, rounding=rounding, generator=generator)
    return QuantizedTensor(data, scale, tensor_scale, x.shape, scheme, x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `q` in `dtype` (same as ``q.dequantize(dtype)``)."""
    if not isinstance(q, QuantizedTensor):
        raise MinifloatError(f"dequantize takes a QuantizedTensor (what minifloat.quantize returns), got {type(q).__name__}")
    return q.dequantize(dtype)


def fake_quantize(
    x: torch.Tensor,
    scheme: str | Scheme,
    *,
    scale: torch.Tensor | float | None = None,
    amax: torch.Tensor | float | None = None,
    rounding: str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Quantize and dequantize: the values `x` takes in `scheme`, in `x`'s dtype.

    Differentiable with the straight-through estimator (the gradient passes unchanged), as
    quantization-aware training expects: the rounding's own gradient is zero almost everywhere.

    Example:
        >>> fake_quantize(torch.tensor([[1.0, 40.0, -96.0]]), "fp4").tolist()  # scale 6/96
        [[0.0, 32.0, -96.0]]
    """
    q = quantize(x.detach(), scheme, scale=scale, amax=amax, rounding=rounding, generator=generator)
    out = dequantize(q, x.dtype)
    if x.requires_grad and torch.is_grad_enabled():
        # not x + (out - x).detach(): that rounds (and makes inf - inf = NaN); out exactly
        out = _StraightThrough.apply(x, out)
    return out


class _StraightThrough(torch.autograd.Function):
    """Forward: `values` as they are; backward: the gradient goes to `x` unchanged."""

    @staticmethod
    def forward(ctx, x, values):
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad, None
