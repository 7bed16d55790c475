"""Encode real numbers to format codes and decode them back — the readable reference.

This module is pure, vectorised PyTorch. It is the path on any device without a fast kernel
and the oracle every fast kernel must equal bit for bit. Bit-exactness is checked against
ml_dtypes in the tests (the library never imports ml_dtypes).

How `encode` rounds, in one paragraph: every input is widened to float64 (exact for fp16,
bf16, fp32 and fp64). Let ``e`` be the binade of ``|x|`` clamped below at the format's
``emin`` (subnormals share the quantum of the smallest binade) and ``q = 2**(e - man_bits)``
the spacing of codes there. ``r = |x| / q`` is exact; rounding ``r`` to an integer ``k`` and
adding ``(e - emin) << man_bits`` gives the magnitude code directly — a carry out of the
mantissa lands in the next binade by itself. Round-to-nearest uses ``torch.round`` (half to
even on the significand ``k``, i.e. IEEE ties-to-even); stochastic rounding rounds up with
probability ``r - floor(r)``.

Specials, matching ml_dtypes (``saturate=False``) or clamping (``saturate=True``):

========  ==================  =====================================  =======================
format    NaN in              overflow / ±inf, saturate=False        saturate=True
========  ==================  =====================================  =======================
e4m3      ±NaN (S.1111.111)   NaN                                    ±448
e5m2      ±NaN (S.11111.10)   ±inf                                   ±57344
e4m3fnuz  NaN (0x80)          NaN                                    ±240
e5m2fnuz  NaN (0x80)          NaN                                    ±57344
e3m2      ∓0 (*)              ±28 (no inf/NaN: saturates)            ±28
e2m3      ∓0 (*)              ±7.5                                   ±7.5
e2m1      ∓0 (*)              ±6                                     ±6
e8m0      NaN (0xFF)          NaN; zero and negatives are NaN too    +inf → 2**127
========  ==================  =====================================  =======================

The fnuz formats have no −0: −0 and a negative value that rounds to zero encode to 0x00.

(*) FP6 and FP4 have no NaN code. Like ml_dtypes, a NaN encodes to a zero whose sign bit is
the NaN's sign bit flipped (+NaN → 0x20 for FP6, 0x8 for FP4), and `encode` warns that it did.
The scaled quantizers carry NaN through the block scale instead, so a NaN never becomes a
finite number there.

E8M0 has no zero and no subnormals: positive values up to 2**-127 encode to 2**-127, and —
an ml_dtypes quirk we reproduce so the codes stay identical — values strictly between 2**-127
and 2**-126 encode to 2**-126 under round-to-nearest.

Float64 inputs are rounded once, correctly. (ml_dtypes converts float64 through float32 and so
rounds twice; the two agree on every float64 that is a float32.)
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Literal

import torch

from minifloat.errors import CodeRangeError, DTypeError, RoundingError
from minifloat.formats.registry import FloatFormat, NaNEncoding, get_format

Rounding = Literal["nearest", "stochastic"]
ROUNDING_MODES: tuple[str, ...] = ("nearest", "stochastic")
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DTYPE_NAMES = "float32, bfloat16, float16, float64"


def check_float_tensor(x: object, what: str, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> torch.Tensor:
    """Return `x` if it is a tensor of one of `dtypes`, else raise DTypeError."""
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{what} takes a torch.Tensor, got {type(x).__name__}; wrap it in torch.tensor(...)")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise DTypeError(f"{what} takes {names} tensors, got {x.dtype}; convert with x.float()")
    return x


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDING_MODES:
        raise RoundingError(f"unknown rounding {rounding!r}; use one of {', '.join(ROUNDING_MODES)}")
    return rounding


def check_codes(codes: object, fmt: FloatFormat, what: str = "decode") -> torch.Tensor:
    """Return `codes` if it is an integer tensor whose values fit `fmt`'s width."""
    if not isinstance(codes, torch.Tensor):
        raise DTypeError(f"{what} takes a torch.Tensor of codes, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise DTypeError(
            f"{what} takes integer codes (torch.uint8, as encode returns), got {codes.dtype}; "
            f"to quantize values use minifloat.encode"
        )
    if codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= fmt.num_codes:
            bad = lo if lo < 0 else hi
            raise CodeRangeError(
                f"{what}: code {bad} does not fit {fmt.name}, whose {fmt.bits}-bit codes are "
                f"0..{fmt.num_codes - 1}; packed data must go through minifloat.unpack first"
            )
    return codes


def pow2(n: torch.Tensor | int) -> torch.Tensor:
    """2**n as float64, exactly, for integers n in [-1022, 1023] (built from the bits)."""
    n = torch.as_tensor(n, dtype=torch.int64)
    return ((n + 1023) << 52).view(torch.float64)


_U32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for uint32 values held in int64, with no int64 overflow (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _U32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply "lowbias32", a bijection of [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_seed(generator: torch.Generator | None = None) -> int:
    """One 64-bit seed for a stochastic-rounding call, drawn from `generator`, else from torch's
    default CPU generator whatever device the tensor is on: a seed drawn on an accelerator
    would make every call wait for it (to read it back), and this way a CPU run and a GPU run
    seeded alike round alike."""
    on = generator.device if generator is not None else "cpu"
    lo, hi = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator, device=on).tolist()
    return lo | hi << 32


def sr_bits(seed: int, numel: int, device=None) -> torch.Tensor:
    """Counter-based random bits: for element i (row-major), the uint32 (held in int64)
    ``mix32(mix32(lo32(i) ^ lo32(seed)) ^ mix32(hi32(i) ^ hi32(seed) + 0x9E3779B9))``.

    The compiled kernels compute the same function of (seed, i) inline, in any thread order,
    so a stochastically rounded tensor does not depend on how the work is split."""
    i = torch.arange(numel, dtype=torch.int64, device=device)
    lo = _mix32((i & _U32) ^ (seed & _U32))
    hi = _mix32((((i >> 32) ^ (seed >> 32)) + 0x9E3779B9) & _U32)
    return _mix32(lo ^ hi)


def random_bits(shape: tuple[int, ...], generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Uniform uint32 random bits (held in int64), one per element of `shape` in row-major
    order: the stochastic-rounding input, `sr_bits` of a seed drawn from `generator`."""
    return sr_bits(sr_seed(generator), math.prod(shape), device).view(shape)


def encode(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    *,
    rounding: Rounding = "nearest",
    saturate: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round `x` to `fmt` and return its codes as ``torch.uint8``, one per byte, same shape.

    Args:
        x: float32 / bfloat16 / float16 / float64 tensor of any shape and strides.
        fmt: format name (``"e4m3"``, ``"float8_e4m3fn"``, ...) or `FloatFormat`.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased; moves a value
            by at most one code): rounds up when a uniform 32-bit random integer ``R``
            satisfies ``R / 2**32 < r - floor(r)``.
        saturate: clamp finite overflow and ±inf to ±max (True), or follow ml_dtypes
            (False): see the module docstring's table.
        generator: random source for stochastic rounding, for reproducibility.

    Example:
        >>> encode(torch.tensor([1.0, -3.0, 500.0]), "e4m3").tolist()
        [56, 196, 126]
    """
    fmt = get_format(fmt)
    check_float_tensor(x, "encode")
    check_rounding(rounding)
    bits = random_bits(x.shape, generator, x.device) if rounding == "stochastic" else None
    if fmt.nan_code is None and fmt.signed and bool(torch.isnan(x).any()):
        warnings.warn(
            f"encode: {fmt.name} has no NaN code, so a NaN encodes to a zero (as in ml_dtypes); "
            "minifloat.quantize keeps NaN by making that block's scale NaN",
            stacklevel=2,
        )
    return encode_with_bits(x, fmt, saturate=saturate, bits=bits)


def encode_with_bits(
    x: torch.Tensor,
    fmt: FloatFormat,
    *,
    saturate: bool = True,
    bits: torch.Tensor | None = None,
    canonical_nan: bool = False,
) -> torch.Tensor:
    """`encode` with round-to-nearest (`bits` None) or stochastic rounding driven by the
    given uint32 random `bits` (int64 tensor of x's shape). No argument checks: internal.

    `canonical_nan` encodes every NaN as the positive NaN: the scaled quantizers use it, since
    the sign of a NaN that arithmetic produced depends on operand order, not on the data."""
    m = fmt.man_bits
    xd = x.to(torch.float64)
    finite = torch.isfinite(xd)
    mag = torch.where(finite, xd.abs(), 0.0)
    # e: the binade of |x|, clamped to [emin, emax]; below emin the subnormals share the
    # quantum of emin, above emax everything overflows anyway.
    _, e = torch.frexp(mag)  # mag = f * 2**e with f in [0.5, 1)
    e = torch.where(mag > 0, e.to(torch.int64) - 1, fmt.emin).clamp(fmt.emin, fmt.emax)
    r = mag * pow2(m - e)  # |x| / quantum: exact, a power-of-two scaling
    r = r.clamp_max(float(1 << (m + 2)))  # beyond this it overflows; keeps int64 safe
    if bits is None:
        k = torch.round(r)  # half to even on the significand = IEEE ties-to-even
    else:
        k = torch.floor(r)
        u = bits.to(torch.float64) * 2.0**-32
        k = k + (u < r - k).to(torch.float64)
    code = ((e - fmt.emin) << m) + k.to(torch.int64)
    if not fmt.has_zero:  # exponent field 0 is a normal binade (E8M0): no implicit offset
        code = (code - (1 << m)).clamp_min(0)
        if bits is None:  # ml_dtypes rounds (2**emin, 2**(emin+1)) up; we match it
            between = (mag > fmt.min_normal) & (mag < 2 * fmt.min_normal)
            code = torch.where(between, 1, code)

    # Overflow (after rounding) and infinities.
    if saturate or fmt.nan is NaNEncoding.NONE:
        overflow_code = fmt.max_code
    else:
        overflow_code = fmt.inf_code if fmt.has_inf else fmt.nan_code
    code = torch.where((code > fmt.max_code) | torch.isinf(xd), overflow_code, code)

    nan = torch.isnan(xd)
    neg = torch.signbit(xd) & ~nan if canonical_nan else torch.signbit(xd)
    if fmt.nan is NaNEncoding.NEG_ZERO:  # no −0: a negative value that rounds to zero is +0; 0x80 is NaN
        code = torch.where(neg & (code != 0), code | fmt.sign_mask, code)
        code = torch.where(nan, fmt.nan_code, code)
    elif fmt.signed:
        code = code | torch.where(neg, fmt.sign_mask, 0)
        if fmt.nan_code is not None:
            code = torch.where(nan, fmt.nan_code | torch.where(neg, fmt.sign_mask, 0), code)
        else:  # ml_dtypes: a NaN becomes the zero with the opposite sign bit
            code = torch.where(nan, torch.where(neg, 0, fmt.sign_mask), code)
    else:  # unsigned, no zero (E8M0): zero, negatives and NaN are NaN
        code = torch.where(neg | nan | (xd == 0), fmt.nan_code, code)
    return code.to(torch.uint8)


@functools.lru_cache(maxsize=64)
def value_table(fmt: FloatFormat, dtype: torch.dtype = torch.float64, device: str = "cpu") -> torch.Tensor:
    """The value of every code of `fmt`, indexed by code (NaN and ±inf where they apply).

    Example:
        >>> value_table(get_format("e2m1"))[:8].tolist()
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    """
    m = fmt.man_bits
    codes = torch.arange(fmt.num_codes, dtype=torch.int64)
    mag = codes & fmt.magnitude_mask
    exp_field, man_field = mag >> m, mag & ((1 << m) - 1)
    if fmt.has_zero:  # exponent field 0: subnormal, no implicit one, exponent emin
        significand = torch.where(exp_field > 0, (1 << m) + man_field, man_field)
        exponent = torch.maximum(exp_field - fmt.bias, torch.tensor(fmt.emin))
    else:
        significand = (1 << m) + man_field
        exponent = exp_field - fmt.bias
    values = significand.to(torch.float64) * pow2(exponent - m)
    values = torch.where((codes & fmt.sign_mask) != 0, -values, values)
    if fmt.nan is NaNEncoding.IEEE:
        top = exp_field == (1 << fmt.exp_bits) - 1
        values = torch.where(top & (man_field == 0), torch.copysign(torch.tensor(torch.inf), values), values)
        values = torch.where(top & (man_field != 0), torch.nan, values)
    elif fmt.nan is NaNEncoding.ALL_ONES:
        values = torch.where(mag == fmt.magnitude_mask, torch.nan, values)
    elif fmt.nan is NaNEncoding.NEG_ZERO:
        values = torch.where(codes == fmt.sign_mask, torch.nan, values)
    return values.to(dtype=dtype, device=device)


def decode(codes: torch.Tensor, fmt: str | FloatFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `codes` (integers, as `encode` returns) in `dtype`, same shape.

    Values outside `dtype`'s range become ±inf by the ordinary cast (only E8M0 → float16).

    Example:
        >>> decode(torch.tensor([56, 196, 126], dtype=torch.uint8), "e4m3").tolist()
        [1.0, -3.0, 448.0]
    """
    fmt = get_format(fmt)
    check_codes(codes, fmt)
    if dtype not in FLOAT_DTYPES:
        raise DTypeError(f"decode returns {_DTYPE_NAMES}, not {dtype}")
    table = value_table(fmt, dtype, str(codes.device))
    return table[codes.long()]
