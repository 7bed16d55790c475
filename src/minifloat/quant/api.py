"""`quantize`, `dequantize`, `fake_quantize`: the quantization API, the one place that builds a
`QuantizedTensor`.

They check the arguments, bring a given scale or amax to the scale grid, and hand plain
tensors to `minifloat.kernels`, which picks the fast path or the readable reference and
returns the parts ``(data, scale, tensor_scale)``. The formulas are in `minifloat.scaling`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifloat import kernels
from minifloat.errors import MinifloatError
from minifloat.formats.codec import check_float_tensor, check_rounding
from minifloat.kernels import reference
from minifloat.quant.tensor import QuantizedTensor
from minifloat.scaling.layout import as_float32, layout_for, to_grid
from minifloat.scaling.rules import decode_scales
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


@dataclass(frozen=True)
class BlockScales:
    """The scales of a tensor's blocks, fixed before any element is rounded (as GPTQ and the
    scale observers need them): ``encode`` the float32 multiplier per block that maps it onto
    the element grid (0 for an all-zero NVFP4 block), ``scale`` the stored scale grid (float32
    decode scales, E8M0 or E4M3 codes), ``tensor_scale`` NVFP4's tensor decode scale."""

    encode: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None = None

    def decode(self, scheme: Scheme) -> torch.Tensor:
        """The float32 decode scale of every block (the grid's shape)."""
        return decode_scales(self.scale, self.tensor_scale, get_scheme(scheme).scale_format)


def block_scales(x: torch.Tensor, scheme: str | Scheme, *, amax: torch.Tensor | float | None = None) -> BlockScales:
    """The scales `quantize` gives `x`'s blocks by `scheme`'s own rule (the ``minmax`` observer):
    ``quantize_with_scales(x, scheme, block_scales(x, scheme))`` is ``quantize(x, scheme)``.
    `amax`: NVFP4's tensor amax (else measured).

    Example:
        >>> s = block_scales(torch.tensor([[1.0, -3.0] * 16]), "mxfp4")
        >>> s.scale.tolist(), s.encode.tolist()  # decode 2^-1 (OCP's floor rule: amax 3 → 6)
        ([[126]], [[2.0]])
    """
    scheme = get_scheme(scheme)
    check_float_tensor(x, "block_scales", QUANTIZE_DTYPES)
    if amax is not None and not scheme.is_nvfp4:
        raise MinifloatError(f"amax= of block_scales is NVFP4's tensor amax; {scheme.name} measures each block's")
    a = None if amax is None else as_float32(amax, "amax").reshape(())
    return BlockScales(*reference.block_scales(x, scheme, amax=a))


def quantize_with_scales(x: torch.Tensor, scheme: str | Scheme, scales: BlockScales) -> QuantizedTensor:
    """Quantize `x` on given block scales (`block_scales`, a scale observer's, GPTQ's): each
    element ``x · encode`` rounded to nearest onto the element grid, saturating.

    Example:
        >>> x = torch.tensor([[0.3, -2.0] * 16])
        >>> s = block_scales(x, "mxfp4")
        >>> torch.equal(quantize_with_scales(x, "mxfp4", s).data, quantize(x, "mxfp4").data)
        True
    """
    scheme = get_scheme(scheme)
    check_float_tensor(x, "quantize_with_scales", QUANTIZE_DTYPES)
    lay = layout_for(x.shape, scheme)
    parts = (scales.encode, scales.scale)
    if any(tuple(p.shape) != lay.grid for p in parts) or (scales.tensor_scale is None) == scheme.is_nvfp4:
        raise MinifloatError(f"the block scales ({tuple(scales.scale.shape)}) do not fit {scheme.name}'s scale grid "
                             f"{lay.grid} of a {tuple(x.shape)} tensor; make them with block_scales(x, scheme)")  # fmt: skip
    data, scale, tensor_scale = reference.quantize_on_scales(x, scheme, scales.encode.float(), scales.scale, scales.tensor_scale)
    return QuantizedTensor(data, scale, tensor_scale, x.shape, scheme, x.dtype)
