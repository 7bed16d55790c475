"""Scaled quantization: the readable reference, and `quantize` which dispatches to fast kernels.

Every scheme works on the 2-D view ``(rows, K)`` of the input (rows = all leading dims),
zero-padded so that the last dim fills whole blocks (and whole bytes once packed) and, for 2-D
blocks, so that the rows fill whole blocks too. Padding never changes an amax and is cropped
on dequantize. The scale grid is always 2-D: ``(rows_pad // block_rows, cols_pad // block_cols)``
— ``(1, 1)`` for a tensor scale, ``(rows, 1)`` for row scales.

`quantize_reference` below is the oracle of the fast kernels (`minifloat.kernels`): they must
give the same bytes. The formulas are in `minifloat.scaling`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minifloat import scaling
from minifloat.codec import _pow2, check_float_tensor, check_rounding, decode, encode_with_bits, random_bits
from minifloat.errors import MinifloatError
from minifloat.formats import E4M3, E8M0
from minifloat.packing import pack, unpack
from minifloat.schemes import Scheme, get_scheme

QUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64: convert first

_PACK_GROUP = {4: 2, 6: 4, 8: 1}


@dataclass(frozen=True)
class Layout:
    """Geometry of a quantized tensor's 2-D view."""

    rows: int
    cols: int
    rows_pad: int
    cols_pad: int
    block_rows: int
    block_cols: int

    @property
    def grid(self) -> tuple[int, int]:
        """Shape of the scale grid."""
        return self.rows_pad // self.block_rows, self.cols_pad // self.block_cols

    @property
    def tiles(self) -> tuple[int, int, int, int]:
        """Shape that views the padded 2-D tensor as (grid rows, block rows, grid cols, block cols)."""
        return self.grid[0], self.block_rows, self.grid[1], self.block_cols


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def layout_for(shape: torch.Size | tuple[int, ...], scheme: Scheme) -> Layout:
    """The padded 2-D geometry of a tensor of `shape` under `scheme`."""
    cols = shape[-1] if len(shape) else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    group = _PACK_GROUP[scheme.element_format.bits]
    if scheme.granularity == "block":
        br, bc = scheme.block
        return Layout(rows, cols, _ceil_to(rows, br), _ceil_to(cols, bc), br, bc)
    cols_pad = _ceil_to(cols, group)
    br = 1 if scheme.granularity == "row" else max(rows, 1)
    return Layout(rows, cols, rows, cols_pad, br, max(cols_pad, 1))


def part_specs(shape: torch.Size | tuple[int, ...], scheme: Scheme) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of every part a `QuantizedTensor` of `shape` under `scheme` holds:
    ``data`` (packed codes), ``scale`` (the scale grid) and, for NVFP4, ``tensor_scale``.

    Example:
        >>> part_specs((3, 40), get_scheme("nvfp4"))["scale"]
        (torch.uint8, (3, 3))
    """
    lay = layout_for(shape, scheme)
    specs = {
        "data": (torch.uint8, (lay.rows_pad, lay.cols_pad * scheme.element_format.bits // 8)),
        "scale": (torch.float32 if scheme.scale_format == "fp32" else torch.uint8, lay.grid),
    }
    if scheme.is_nvfp4:
        specs["tensor_scale"] = (torch.float32, ())
    return specs


def check_parts(q) -> None:
    """Raise `MinifloatError` unless `q`'s parts have the dtypes and shapes its shape and scheme
    imply (`part_specs`): the kernels index them by that geometry."""
    specs = part_specs(q.shape, q.scheme)
    for part in ("data", "scale", "tensor_scale"):
        t = getattr(q, part)
        if part not in specs:
            if t is not None:
                raise MinifloatError(f"a {q.scheme.name} QuantizedTensor has no {part}; got one of shape {tuple(t.shape)}")
            continue
        dtype, shape = specs[part]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise MinifloatError(
                f"the {part} of a {q.scheme.name} QuantizedTensor of shape {tuple(q.shape)} must be {dtype} of "
                f"shape {shape}; got {got}"
            )


def _as_float32(value: torch.Tensor | float, what: str) -> torch.Tensor:
    try:
        return scaling.canonical_nan(torch.as_tensor(value, dtype=torch.float32))
    except (TypeError, ValueError, RuntimeError):
        raise MinifloatError(f"{what} must be a number or a float tensor, got {type(value).__name__} {value!r}") from None


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


def _grid_scale(value: torch.Tensor | float, layout: Layout, what: str) -> torch.Tensor:
    """A user-given scale or amax broadcast to the scale grid (float32)."""
    t = _as_float32(value, what)
    try:
        return torch.broadcast_to(t.reshape(t.shape if t.dim() != 1 else (-1, 1)), layout.grid).contiguous()
    except RuntimeError:
        raise MinifloatError(
            f"{what} of shape {tuple(t.shape)} does not fit the scale grid {layout.grid}; "
            f"pass a scalar, or one value per block"
        ) from None


def quantize_reference(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    scale: torch.Tensor | float | None = None,
    amax: torch.Tensor | float | None = None,
    rounding: str | None = None,
    generator: torch.Generator | None = None,
):
    """Pure-PyTorch quantization by the published formulas; returns a `QuantizedTensor`."""
    from minifloat.tensor import QuantizedTensor

    rounding = rounding or scheme.rounding
    fmt = scheme.element_format
    lay = layout_for(x.shape, scheme)
    xp = F.pad(x.reshape(lay.rows, lay.cols).float(), (0, lay.cols_pad - lay.cols, 0, lay.rows_pad - lay.rows))
    tiles = xp.view(lay.tiles)  # (grid rows, block rows, grid cols, block cols)
    tensor_scale = None

    if scheme.scale_format == "fp32":
        if scale is not None:
            enc = _grid_scale(scale, lay, "scale")
        else:
            a = _grid_scale(amax, lay, "amax") if amax is not None else scaling.finite_amax(tiles, dim=(1, 3))
            enc = scaling.fp32_scale(a, fmt, scheme.margin)
        stored = 1.0 / enc  # the decode scale (TE's scale_inv)
        if fmt.nan_code is None:  # FP6 / FP4 codes cannot hold a NaN, nor can a given scale
            stored = torch.where(torch.isnan(tiles).any(dim=(1, 3)), torch.nan, stored)
    elif scheme.scale_format == "e8m0":
        exp = scaling.e8m0_exponent(scaling.finite_amax(tiles, dim=(1, 3)), fmt, scheme.scale_rule)
        enc = torch.where(torch.isnan(exp), torch.nan, _pow2(-exp.nan_to_num().long()).float())
        stored = torch.where(torch.isnan(exp), E8M0.nan_code, exp.nan_to_num() + E8M0.bias).to(torch.uint8)
    else:  # NVFP4: E4M3 block scales under an FP32 tensor scale
        g_amax = scaling.finite_amax(xp, ignore_nan=True) if amax is None else _as_float32(amax, "amax")
        s_enc = scaling.nvfp4_global_scale(g_amax.reshape(()))
        tensor_scale = 1.0 / s_enc
        stored = scaling.nvfp4_block_scale_codes(scaling.finite_amax(tiles, dim=(1, 3)), s_enc)
        dec = decode(stored, E4M3) * tensor_scale
        enc = torch.where(dec == 0, 0.0, 1.0 / dec)

    y = tiles * enc[:, None, :, None]
    bits = random_bits(y.shape, generator, y.device) if rounding == "stochastic" else None
    codes = encode_with_bits(y, fmt, saturate=True, bits=bits, canonical_nan=True)
    data = pack(codes.view(lay.rows_pad, lay.cols_pad), fmt).view(lay.rows_pad, lay.cols_pad * fmt.bits // 8)
    return QuantizedTensor(data, stored, tensor_scale, x.shape, scheme, x.dtype)


def decode_scales(q) -> torch.Tensor:
    """The float32 decode scale of every block (the scale grid), NaN where a block is NaN."""
    if q.scheme.scale_format == "fp32":
        return q.scale
    if q.scheme.scale_format == "e8m0":
        return decode(q.scale, E8M0)
    return decode(q.scale, E4M3) * q.tensor_scale


def dequantize_reference(q, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-PyTorch dequantization: ``decode(codes) * decode_scale`` per block, cropped."""
    lay = layout_for(q.shape, q.scheme)
    fmt = q.scheme.element_format
    codes = unpack(q.data.reshape(-1), fmt, lay.rows_pad * lay.cols_pad)
    values = decode(codes, fmt).view(lay.tiles) * decode_scales(q)[:, None, :, None]
    return values.view(lay.rows_pad, lay.cols_pad)[: lay.rows, : lay.cols].reshape(q.shape).to(dtype)


def quantize(
    x: torch.Tensor,
    scheme: str | Scheme,
    *,
    scale: torch.Tensor | float | None = None,
    amax: torch.Tensor | float | None = None,
    rounding: str | None = None,
    generator: torch.Generator | None = None,
):
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
        _check_scale(_as_float32(scale, "scale"))
    a = None if amax is None else _as_float32(amax, "amax")
    if a is not None and a.device.type == "cpu" and bool((a < 0).any()):  # no device sync, as _check_scale
        raise MinifloatError(f"amax is a largest magnitude, ≥ 0; got {amax!r} (pass abs(x).max(), not x.max())")
    if a is not None and scheme.is_nvfp4 and a.numel() != 1:
        raise MinifloatError(
            f"amax= for {scheme.name} is the tensor amax, one value; got shape {tuple(a.shape)} "
            f"(the block scales come from each block's amax)"
        )
    from minifloat import kernels

    impl = kernels.quantize_impl(x)
    return impl(x, scheme, scale=scale, amax=amax, rounding=rounding, generator=generator)


def dequantize(q, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `q` in `dtype` (same as ``q.dequantize(dtype)``)."""
    from minifloat import kernels

    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise MinifloatError(f"dequantize returns floating-point values; got dtype={dtype!r}, use e.g. torch.float32")
    check_parts(q)

    return kernels.dequantize_impl(q)(q, dtype)


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
