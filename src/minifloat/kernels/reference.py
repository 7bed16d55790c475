"""The readable references of the fast paths: pure PyTorch, by the published formulas.

Each takes plain tensors and returns what its fast path returns — the quantizer the parts
``(data, scale, tensor_scale)``, the dequantizer the values — and each fast path must equal
its reference bit for bit (``tests/kernels/test_kernels.py``). They run wherever no fast path applies
(another device, a build that failed, ``MINIFLOAT_KERNELS=reference``). The scale formulas
are in `minifloat.scaling.rules`, the geometry in `minifloat.scaling.layout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minifloat.formats.codec import decode, encode_with_bits, pow2, random_bits
from minifloat.formats.packing import pack, unpack
from minifloat.formats.registry import E4M3, E8M0, get_format
from minifloat.scaling import rules
from minifloat.scaling.layout import layout_for
from minifloat.scaling.schemes import Scheme

Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(data, scale, tensor_scale)``: packed codes, the stored scale grid, the NVFP4 tensor scale."""


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Parts:
    """Quantize `x` by the published formulas: its block scales (`block_scales`), then every
    element on its block's grid (`quantize_on_scales`).

    `scale` (FP32 schemes) is the encode multiplier per block, `amax` the amax to derive it
    from (FP32 schemes: per block; NVFP4: the tensor amax, 0-d), both float32 and already
    broadcast to the scale grid (`minifloat.scaling.layout.to_grid`)."""
    enc, stored, tensor_scale = block_scales(x, scheme, scale=scale, amax=amax)
    return quantize_on_scales(x, scheme, enc, stored, tensor_scale, rounding=rounding, generator=generator)


def padded_tiles(x: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` as its zero-padded 2-D view and as tiles (grid rows, block rows, grid cols, block cols)."""
    lay = layout_for(x.shape, scheme)
    xp = F.pad(x.reshape(lay.rows, lay.cols).float(), (0, lay.cols_pad - lay.cols, 0, lay.rows_pad - lay.rows))
    return xp, xp.view(lay.tiles)


def block_scales(
    x: torch.Tensor, scheme: Scheme, *, scale: torch.Tensor | None = None, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(encode, stored, tensor_scale)`` of `x`'s blocks: the float32 multiplier that maps each
    block onto the element grid (0 for an all-zero NVFP4 block), the stored scale grid (float32
    decode scales, E8M0 or E4M3 codes) and NVFP4's tensor decode scale (else None)."""
    fmt = scheme.element_format
    xp, tiles = padded_tiles(x, scheme)
    tensor_scale = None
    if scheme.scale_format == "fp32":
        if scale is not None:
            enc = scale
        else:
            a = amax if amax is not None else rules.finite_amax(tiles, dim=(1, 3))
            enc = rules.fp32_scale(a, fmt, scheme.margin)
        stored = 1.0 / enc  # the decode scale (TE's scale_inv)
        if fmt.nan_code is None:  # FP6 / FP4 codes cannot hold a NaN, nor can a given scale
            stored = torch.where(torch.isnan(tiles).any(dim=(1, 3)), torch.nan, stored)
        stored = torch.where(torch.isnan(stored), torch.nan, stored)  # one NaN (0x7FC00000), as the CPU kernel stores; CUDA's is 0x7FFFFFFF
    elif scheme.scale_format == "e8m0":
        block_amax = rules.finite_amax(tiles, dim=(1, 3))
        exp = rules.e8m0_exponent(block_amax, fmt, "floor" if scheme.scale_rule == "least-error" else scheme.scale_rule)
        if scheme.scale_rule == "least-error":
            exp = _best_exponent(tiles, exp, block_amax, fmt)
        enc = torch.where(torch.isnan(exp), torch.nan, pow2(-exp.nan_to_num().long()).float())
        stored = torch.where(torch.isnan(exp), E8M0.nan_code, exp.nan_to_num() + E8M0.bias).to(torch.uint8)
    else:  # NVFP4: E4M3 block scales under an FP32 tensor scale
        four_over_six = scheme.scale_rule == "4over6"
        g_amax = rules.finite_amax(xp, ignore_nan=True) if amax is None else amax
        numerator = rules.NVFP4_4OVER6_NUMERATOR if four_over_six else rules.NVFP4_GLOBAL_NUMERATOR
        s_enc = rules.nvfp4_global_scale(g_amax.reshape(()), numerator)
        tensor_scale = 1.0 / s_enc
        block_amax = rules.finite_amax(tiles, dim=(1, 3))
        stored = rules.nvfp4_block_scale_codes(block_amax, s_enc)
        if four_over_six:  # the candidate scaled to 4 where it quantizes the block better
            stored = _four_over_six(tiles, stored, rules.nvfp4_block_scale_codes(block_amax, s_enc, 1.5), tensor_scale)
        enc = rules.nvfp4_encode_scales(stored, tensor_scale)
    return enc, stored, tensor_scale


def quantize_on_scales(
    x: torch.Tensor,
    scheme: Scheme,
    encode: torch.Tensor,
    stored: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Parts:
    """The parts of `x` with its blocks' scales given (`block_scales`' three): each element
    ``x · encode`` rounded onto the element grid (saturating), packed."""
    fmt = scheme.element_format
    lay = layout_for(x.shape, scheme)
    _, tiles = padded_tiles(x, scheme)
    y = tiles * encode[:, None, :, None]
    bits = random_bits(y.shape, generator, y.device) if rounding == "stochastic" else None
    codes = encode_with_bits(y, fmt, saturate=True, bits=bits, canonical_nan=True)
    data = pack(codes.view(lay.rows_pad, lay.cols_pad), fmt).view(lay.rows_pad, lay.cols_pad * fmt.bits // 8)
    return data, stored, tensor_scale


def _block_sq_errors(tiles: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor, fmt) -> torch.Tensor:
    """Per block, the sum of squared errors of its round-to-nearest codes under the encode scale
    `enc` (decoded as ``decode(code) · dec``), in float64, summed over the block's rows, then
    its columns, one by one in that order (the CPU kernel's order, so that both choose alike
    on near-ties). `enc` and `dec` are (grid rows, grid cols)."""
    codes = encode_with_bits(tiles * enc[:, None, :, None], fmt, saturate=True, canonical_nan=True)
    sq = (decode(codes, fmt).double() * dec.double()[:, None, :, None] - tiles.double()).square()
    sq = sq.permute(0, 2, 1, 3).flatten(2)  # (grid rows, grid cols, block elements in row-major order)
    total = torch.zeros(sq.shape[:2], dtype=torch.float64, device=sq.device)
    for i in range(sq.shape[2]):
        total = total + sq[:, :, i]
    return total


def _four_over_six(tiles: torch.Tensor, six: torch.Tensor, four: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """Per block, the E4M3 scale code of the candidate (amax to 6, or to 4) whose round-to-
    nearest quantization has the smaller sum of squared errors (`_block_sq_errors`); a tie keeps 6."""
    errors = []
    for stored in (six, four):
        dec = decode(stored, E4M3) * tensor_scale  # as rules.nvfp4_encode_scales inverts it
        errors.append(_block_sq_errors(tiles, torch.where(dec == 0, 0.0, 1.0 / dec), dec, get_format("e2m1")))
    return torch.where(errors[1] < errors[0], four, six)


def _best_exponent(tiles: torch.Tensor, exp: torch.Tensor, amax: torch.Tensor, fmt) -> torch.Tensor:
    """The ``"least-error"`` E8M0 rule: per block, the floor exponent `exp`, or ``exp + 1`` where the
    floor clips the amax (``amax · 2^-exp > max``, exp < 127), whichever quantizes the block with
    the smaller sum of squared errors (`_block_sq_errors`); a tie keeps the floor."""
    e = exp.nan_to_num()
    clips = (amax * pow2(-e.long()).float() > fmt.max) & (e < 127)
    errors = [_block_sq_errors(tiles, pow2(-k.long()).float(), pow2(k.long()).float(), fmt) for k in (e, e + 1)]
    return torch.where(clips & (errors[1] < errors[0]), exp + 1, exp)


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    shape: torch.Size,
    scheme: Scheme,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``decode(codes) * decode_scale`` per block, cropped to `shape`, in `dtype`."""
    lay = layout_for(shape, scheme)
    fmt = scheme.element_format
    codes = unpack(data.reshape(-1), fmt, lay.rows_pad * lay.cols_pad)
    scales = rules.decode_scales(scale, tensor_scale, scheme.scale_format)
    values = decode(codes, fmt).view(lay.tiles) * scales[:, None, :, None]
    return values.view(lay.rows_pad, lay.cols_pad)[: lay.rows, : lay.cols].reshape(shape).to(dtype)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The random Hadamard transform (`minifloat.quant.hadamard.rht`) of float32 `x` whose
    last dim is a multiple of n = len(signs): the fast Walsh–Hadamard transform in a fixed
    order, so every device computes the same bits.

    Each group v (n values) becomes v ⊙ s; then for h = 1, 2, 4, ..., n/2 every pair (v[i],
    v[i + h]) with i mod 2h < h becomes (v[i] + v[i + h], v[i] - v[i + h]); finally × 1/sqrt(n)
    (a power of two for n = 4^k). In exact arithmetic that is ``v @ T`` (`hadamard_matrix`)."""
    n = signs.numel()
    y = x.reshape(-1, n) * signs.to(x.device)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * n**-0.5).to(torch.float32)
