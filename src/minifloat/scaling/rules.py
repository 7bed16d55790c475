"""Scales: the amax → scale rules of every scale format (the histories that delayed scaling
reduces to an amax are in `minifloat.scaling.history`).

Conventions (those of Transformer Engine): a *scale* multiplies high-precision values into the
element format's range (``q = encode(x * scale)``); the *decode scale* (``scale_inv``)
multiplies codes back (``x ≈ decode(q) * scale_inv``). What a `QuantizedTensor` stores is the
decode scale, in its scale format.

Rules, with their sources:

- FP32 scales (TE ``DelayedScaling`` / ``Float8CurrentScaling``, DeepSeek-V3 §3.3 blocks):
  ``scale = max_elem / amax / 2**margin`` in float32; amax 0 or inf → 1 (TE's
  ``compute_scale_from_amax``); an infinite result → the largest float32; a NaN amax gives a
  NaN scale (the tensor, row or block decodes to NaN). Delayed scaling keeps the previous
  scale instead when the amax is not a positive finite number.
- E8M0 scales (OCP MX v1.0 §6.3): rule ``"floor"``: ``X = 2**(floor(log2 amax) - emax_elem)``;
  rule ``"rceil"`` (NVIDIA): ``X = 2**ceil(log2(amax * (1/max_elem)))``; the exponent is
  clamped to [-127, 127]; amax 0 → X = 1; NaN amax → the NaN code 0xFF.
- NVFP4 (NVIDIA's two-level formula, as in TE's reference): global encode scale
  ``S_enc = 448 * 6 / amax_tensor`` (amax 0 → 1, inf → largest float32), tensor decode scale
  ``S_dec = 1 / S_enc``; block decode scale ``E4M3(min(amax_block / 6 * S_enc, FLT_MAX))``,
  saturating at 448; elements ``encode(x * (1 / (block_scale * S_dec)))``.

amax is the largest *finite* magnitude (±inf saturate rather than zero the rest of the tensor),
NaN-propagating except for the NVFP4 tensor amax, which skips NaN so that a NaN poisons its
16-element block and not the whole tensor.
"""

from __future__ import annotations

import ctypes
import math

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import decode, encode_with_bits
from minifloat.formats.registry import E4M3, E8M0, FloatFormat, get_format

FLOAT32_MAX = torch.finfo(torch.float32).max
NVFP4_GLOBAL_NUMERATOR = 448.0 * 6.0  # E4M3 max × E2M1 max
# Four Over Six maps the tensor amax to 256 · 6, so that a block scaled to 4 (its scale × 1.5)
# stays within E4M3 (at most 384 ≤ 448), as the authors' reference does.
NVFP4_4OVER6_NUMERATOR = 256.0 * 6.0


def finite_amax(x: torch.Tensor, dim=None, *, ignore_nan: bool = False) -> torch.Tensor:
    """max |x| over finite values (float32); NaN propagates unless `ignore_nan`.

    Example:
        >>> finite_amax(torch.tensor([1.0, -3.0, float("inf")])).item()
        3.0
    """
    a = x.float().abs()
    a = torch.where(torch.isfinite(a) if ignore_nan else ~torch.isinf(a), a, 0.0)
    if dim is None:
        m = a.amax() if a.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    else:
        m = a.amax(dim=dim)
    # one NaN (the default quiet NaN, as the kernels make): which NaN a reduction returns
    # depends on the memory layout, and it ends up in stored decode scales
    return canonical_nan(m)


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """`t` with every NaN replaced by the default quiet NaN (float32 bits 0x7fc00000)."""
    return torch.where(torch.isnan(t), torch.nan, t)


def fp32_scale(amax: torch.Tensor, fmt: FloatFormat, margin: int = 0) -> torch.Tensor:
    """Encode multiplier ``max / amax / 2**margin`` (float32) with TE's special cases.

    Example:
        >>> fp32_scale(torch.tensor([224.0, 0.0, 1e-45, float("inf")]), get_format("e4m3")).tolist()
        [2.0, 1.0, 3.4028234663852886e+38, 1.0]
    """
    amax = amax.float()
    scale = torch.tensor(fmt.max, dtype=torch.float32, device=amax.device) / amax
    scale = scale * math.ldexp(1.0, -margin)
    scale = torch.where(torch.isinf(scale), FLOAT32_MAX, scale)
    return torch.where((amax == 0) | torch.isinf(amax), 1.0, scale)  # inf: the scale 0 would decode as NaN


def e8m0_exponent(amax: torch.Tensor, fmt: FloatFormat, rule: str = "floor") -> torch.Tensor:
    """Unbiased E8M0 scale exponent per block (float32 holding an integer; NaN for NaN amax).

    Example:
        >>> e8m0_exponent(torch.tensor([448.0, 449.0, 0.0]), get_format("e4m3")).tolist()
        [0.0, 0.0, 0.0]
        >>> e8m0_exponent(torch.tensor([448.0, 449.0]), get_format("e4m3"), "rceil").tolist()
        [0.0, 1.0]
    """
    amax = amax.float()
    if rule == "floor":  # OCP MX v1.0 §6.3
        _, e = torch.frexp(amax)
        exp = (e - 1 - fmt.emax).float()
    elif rule == "rceil":  # round amax / max up to a power of two (NVIDIA)
        ratio = amax * torch.tensor(1.0 / fmt.max, dtype=torch.float32)
        mant, e = torch.frexp(ratio)
        exp = (e - 1).float() + (mant != 0.5).float()
    else:
        raise MinifloatError(f"unknown MX scale rule {rule!r}; use 'floor' or 'rceil'")
    exp = torch.where(amax == 0, 0.0, exp.clamp(-127, 127))
    return torch.where(torch.isnan(amax), torch.nan, exp)


def nvfp4_global_scale(amax: torch.Tensor, numerator: float = NVFP4_GLOBAL_NUMERATOR) -> torch.Tensor:
    """NVFP4 global encode scale ``S_enc = 448·6 / amax`` (float32), 1 for amax 0.

    Example:
        >>> nvfp4_global_scale(torch.tensor(2688.0)).item()
        1.0
    """
    amax = amax.float()
    s = torch.tensor(numerator, dtype=torch.float32, device=amax.device) / amax
    s = s.clamp_max(FLOAT32_MAX)
    return torch.where((amax == 0) | (s == 0), 1.0, s)


def as_float32(v: float) -> float:
    """`v` rounded to float32 (to nearest even; beyond the range: ±inf), as a Python float.

    One float32 operation done in float64 and rounded once gives the float32 result bit for
    bit (+, -, *, / of float32 operands: 53 >= 2·24 + 2 bits), which is how the scalar rules
    below equal their tensor versions.

    Example:
        >>> as_float32(0.1), as_float32(1e39)
        (0.10000000149011612, inf)
    """
    return ctypes.c_float(v).value


def fp32_scale_scalar(amax: float, fmt: FloatFormat, margin: int = 0) -> float:
    """`fp32_scale` of one float32 amax without tensor operations (the per-call cost of a
    just-in-time tensor scale in the CPU kernels).

    Example:
        >>> fp32_scale_scalar(3.5, get_format("e4m3")), fp32_scale_scalar(0.0, get_format("e4m3"))
        (128.0, 1.0)
    """
    if amax == 0 or math.isinf(amax):
        return 1.0
    s = as_float32(as_float32(fmt.max / amax) * as_float32(math.ldexp(1.0, -margin)))  # NaN amax: NaN
    return FLOAT32_MAX if math.isinf(s) else s


def nvfp4_global_scale_scalar(amax: float, numerator: float = NVFP4_GLOBAL_NUMERATOR) -> float:
    """`nvfp4_global_scale` of one float32 amax without tensor operations.

    Example:
        >>> nvfp4_global_scale_scalar(2688.0), nvfp4_global_scale_scalar(0.0)
        (1.0, 1.0)
    """
    if amax == 0 or math.isinf(amax):
        return 1.0
    s = as_float32(numerator / amax)
    s = FLOAT32_MAX if s > FLOAT32_MAX else s  # NaN stays NaN, as clamp_max keeps it
    return 1.0 if s == 0 else s


def nvfp4_block_scale_codes(block_amax: torch.Tensor, global_scale: torch.Tensor, expand: float = 1.0) -> torch.Tensor:
    """E4M3 codes of the NVFP4 block decode scales (saturating at 448; NaN amax → NaN code);
    `expand` 1.5 gives Four Over Six's second candidate, which maps the block amax to 4."""
    # A true division: CUDA divides by a host scalar as a product with its reciprocal, one
    # rounding more, which moved E4M3 codes of bfloat16 inputs against the CPU's.
    a = block_amax.float()
    s = (a / a.new_full((), 6.0)) * global_scale
    if expand != 1.0:
        s = s * expand
    return encode_with_bits(s.clamp_max(FLOAT32_MAX), E4M3, saturate=True, canonical_nan=True)


def nvfp4_encode_scales(stored: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """The encode multiplier of each NVFP4 block: 1 / (E4M3 block scale × tensor scale), 0 for
    a zero block scale."""
    dec = decode(stored, E4M3) * tensor_scale
    return torch.where(dec == 0, 0.0, 1.0 / dec)


def scale_from_amax(
    amax: torch.Tensor | float, fmt: str | FloatFormat, margin: int = 0, previous: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Delayed-scaling rule of TE: ``max / amax / 2**margin``; an amax that is not a positive
    finite number (0, negative, inf, NaN) keeps `previous` (1.0 when there is none).

    Example:
        >>> scale_from_amax(torch.tensor(3.5), "e4m3").item()
        128.0
        >>> scale_from_amax(torch.tensor(float("nan")), "e4m3", previous=4.0).item()
        4.0
    """
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    prev = torch.as_tensor(1.0 if previous is None else previous, dtype=torch.float32, device=amax.device)
    fresh = fp32_scale(amax, fmt, margin)
    keep = ~(amax > 0) | torch.isinf(amax)
    return torch.where(keep, prev, fresh)


def decode_scales(scale: torch.Tensor, tensor_scale: torch.Tensor | None, scale_format: str) -> torch.Tensor:
    """The float32 decode scale of every block from the stored scale grid (float32, or E8M0 /
    E4M3 codes) and the NVFP4 tensor scale; NaN where a block is NaN.

    Example:
        >>> decode_scales(torch.tensor([[127, 130]], dtype=torch.uint8), None, "e8m0").tolist()
        [[1.0, 8.0]]
    """
    if scale_format == "fp32":
        return scale
    if scale_format == "e8m0":
        return decode(scale, E8M0)
    return decode(scale, E4M3) * tensor_scale
