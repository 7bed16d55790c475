"""Element formats: the only place bit layouts are written.

A format is data: (exponent bits, mantissa bits, bias, sign, inf/NaN encoding, zero). Every
other property — max, min normal, min subnormal, epsilon, the MX `emax`, the code of the
largest finite value — is derived from those, never typed a second time (the approach of
ml_dtypes). Tables printed by the CLI and numbers in the docs come from these objects.

Example:
    >>> import minifloat
    >>> fmt = minifloat.get_format("float8_e4m3fn")
    >>> fmt.name, fmt.max, fmt.min_subnormal
    ('e4m3', 448.0, 0.001953125)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from minifloat.errors import MinifloatError, UnknownFormatError


class NaNEncoding(str, enum.Enum):
    """How a format spells NaN."""

    NONE = "none"
    """No NaN code at all (FP6, FP4)."""
    IEEE = "ieee"
    """Exponent all ones with a non-zero mantissa is NaN; with a zero mantissa it is inf."""
    ALL_ONES = "all_ones"
    """Only the all-ones magnitude is NaN (E4M3 "fn": S.1111.111; E8M0: 0xFF)."""
    NEG_ZERO = "neg_zero"
    """The code of −0 (sign bit alone, 0x80) is the one NaN; there is no −0 and no inf (AMD's "fnuz")."""


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format of at most 8 bits.

    Attributes:
        name: canonical short name, e.g. ``"e4m3"``.
        exp_bits: exponent field width.
        man_bits: explicit mantissa bits (the implicit leading one is not counted).
        bias: exponent bias.
        has_inf: whether the format encodes ±inf (IEEE-style formats only).
        nan: how NaN is encoded.
        signed: whether there is a sign bit (E8M0 has none).
        has_zero: whether exponent field 0 means zero/subnormal; when False (E8M0) it is an
            ordinary exponent and the format has no zero.
        aliases: other accepted spellings (ml_dtypes / torch dtype names).
        torch_dtype: name of the matching ``torch`` dtype, if torch has one.
        role: one line on what the format is for.
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    has_inf: bool
    nan: NaNEncoding
    signed: bool = True
    has_zero: bool = True
    aliases: tuple[str, ...] = field(default=(), compare=False)
    torch_dtype: str | None = field(default=None, compare=False)
    role: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        bad = None
        if self.exp_bits < 1 or self.man_bits < 0:
            bad = f"exp_bits={self.exp_bits}, man_bits={self.man_bits}: a format has ≥ 1 exponent and ≥ 0 mantissa bits"
        elif self.bits > 8:
            bad = f"{self.bits} bits: minifloat's codes and packing hold formats of at most 8 bits"
        elif self.has_inf and self.nan is not NaNEncoding.IEEE:
            bad = "has_inf=True: only IEEE-style formats (nan=NaNEncoding.IEEE) encode infinities"
        elif self.nan is NaNEncoding.NEG_ZERO and not (self.signed and self.has_zero):
            bad = "nan=NaNEncoding.NEG_ZERO spells NaN as −0: it needs a sign bit and a zero"
        elif self.nan is NaNEncoding.IEEE and self.man_bits == 0:
            bad = "nan=NaNEncoding.IEEE needs ≥ 1 mantissa bit to tell NaN from inf; use ALL_ONES or NONE"
        if bad:
            raise MinifloatError(f"FloatFormat {self.name!r}: {bad}")

    # --- bit layout -------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total width in bits."""
        return int(self.signed) + self.exp_bits + self.man_bits

    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    @property
    def sign_mask(self) -> int:
        """The sign bit of a code (0 for unsigned formats)."""
        return 1 << (self.bits - 1) if self.signed else 0

    @property
    def magnitude_mask(self) -> int:
        return (1 << (self.exp_bits + self.man_bits)) - 1

    @property
    def max_code(self) -> int:
        """Magnitude code of the largest finite value."""
        if self.nan is NaNEncoding.IEEE:  # the top exponent is reserved for inf/NaN
            return (((1 << self.exp_bits) - 2) << self.man_bits) | ((1 << self.man_bits) - 1)
        if self.nan is NaNEncoding.ALL_ONES:  # only the all-ones magnitude is NaN
            return self.magnitude_mask - 1
        return self.magnitude_mask  # NONE, NEG_ZERO: every magnitude is a number

    @property
    def nan_code(self) -> int | None:
        """The canonical NaN code (the positive one ml_dtypes produces; fnuz's only NaN, 0x80), or None."""
        if self.nan is NaNEncoding.IEEE:  # quiet NaN: top mantissa bit set
            return (((1 << self.exp_bits) - 1) << self.man_bits) | (1 << (self.man_bits - 1))
        if self.nan is NaNEncoding.ALL_ONES:
            return self.magnitude_mask
        if self.nan is NaNEncoding.NEG_ZERO:
            return self.sign_mask
        return None

    @property
    def inf_code(self) -> int | None:
        """Positive infinity code, or None."""
        return ((1 << self.exp_bits) - 1) << self.man_bits if self.has_inf else None

    # --- derived values ---------------------------------------------------------------
    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (subnormals share its quantum)."""
        return 1 - self.bias if self.has_zero else -self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal value: the ``emax_elem`` of the OCP MX scale rule."""
        return (self.max_code >> self.man_bits) - self.bias

    @property
    def max(self) -> float:
        frac = (self.max_code & ((1 << self.man_bits) - 1)) / (1 << self.man_bits)
        return math.ldexp(1.0 + frac, self.emax)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (equals `min_normal` when there are no subnormals)."""
        if self.has_zero and self.man_bits > 0:
            return math.ldexp(1.0, self.emin - self.man_bits)
        return self.min_normal

    @property
    def has_subnormals(self) -> bool:
        return self.has_zero and self.man_bits > 0

    @property
    def epsilon(self) -> float:
        """Distance from 1.0 to the next larger value."""
        return math.ldexp(1.0, -self.man_bits)

    @property
    def values_in_1_2(self) -> int:
        """How many values lie in [1, 2): the precision in one binade."""
        return 1 << self.man_bits

    @property
    def dynamic_range_binades(self) -> float:
        """log2(max / smallest positive value)."""
        return math.log2(self.max / self.min_subnormal)

    @property
    def memory_vs_fp16(self) -> float:
        return self.bits / 16

    def describe(self) -> dict[str, object]:
        """Every property as a JSON-ready dict (the rows of `minifloat formats`)."""
        return {
            "name": self.name,
            "aliases": list(self.aliases),
            "bits": self.bits,
            "sign_bits": int(self.signed),
            "exp_bits": self.exp_bits,
            "man_bits": self.man_bits,
            "bias": self.bias,
            "has_inf": self.has_inf,
            "nan": self.nan.value,
            "has_zero": self.has_zero,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "epsilon": self.epsilon,
            "emax": self.emax,
            "emin": self.emin,
            "values_in_1_2": self.values_in_1_2,
            "dynamic_range_binades": self.dynamic_range_binades,
            "memory_vs_fp16": self.memory_vs_fp16,
            "torch_dtype": self.torch_dtype,
            "role": self.role,
        }

    def __repr__(self) -> str:
        return f"FloatFormat({self.name!r})"


E4M3 = FloatFormat(
    "e4m3", exp_bits=4, man_bits=3, bias=7, has_inf=False, nan=NaNEncoding.ALL_ONES,
    aliases=("float8_e4m3fn", "e4m3fn", "fp8_e4m3"), torch_dtype="float8_e4m3fn",
    role="FP8 weights and activations: more precision, less range",
)
E5M2 = FloatFormat(
    "e5m2", exp_bits=5, man_bits=2, bias=15, has_inf=True, nan=NaNEncoding.IEEE,
    aliases=("float8_e5m2", "fp8_e5m2"), torch_dtype="float8_e5m2",
    role="FP8 gradients: more range, less precision",
)
# AMD's FP8 (MI300): one more binade below, none above, no −0 — the same bits as an "fn" code read
# with a bias one larger, so a value stored in e4m3fn reads back halved as e4m3fnuz (the factor of two
# between an OCP checkpoint and its fnuz reading: `fnuz_scale_factor`).
E4M3FNUZ = FloatFormat(
    "e4m3fnuz", exp_bits=4, man_bits=3, bias=8, has_inf=False, nan=NaNEncoding.NEG_ZERO,
    aliases=("float8_e4m3fnuz", "fp8_e4m3fnuz"), torch_dtype="float8_e4m3fnuz",
    role="AMD FP8 (MI300) weights and activations",
)
E5M2FNUZ = FloatFormat(
    "e5m2fnuz", exp_bits=5, man_bits=2, bias=16, has_inf=False, nan=NaNEncoding.NEG_ZERO,
    aliases=("float8_e5m2fnuz", "fp8_e5m2fnuz"), torch_dtype="float8_e5m2fnuz",
    role="AMD FP8 (MI300) gradients",
)
E3M2 = FloatFormat(
    "e3m2", exp_bits=3, man_bits=2, bias=3, has_inf=False, nan=NaNEncoding.NONE,
    aliases=("float6_e3m2fn", "fp6_e3m2"),
    role="FP6 (MXFP6) with range for gradients",
)
E2M3 = FloatFormat(
    "e2m3", exp_bits=2, man_bits=3, bias=1, has_inf=False, nan=NaNEncoding.NONE,
    aliases=("float6_e2m3fn", "fp6_e2m3"),
    role="FP6 (MXFP6) with precision for weights/activations",
)
E2M1 = FloatFormat(
    "e2m1", exp_bits=2, man_bits=1, bias=1, has_inf=False, nan=NaNEncoding.NONE,
    aliases=("float4_e2m1fn", "float4_e2m1fn_x2", "fp4", "fp4_e2m1"),
    torch_dtype="float4_e2m1fn_x2",
    role="FP4 (MXFP4, NVFP4) elements",
)
E8M0 = FloatFormat(
    "e8m0", exp_bits=8, man_bits=0, bias=127, has_inf=False, nan=NaNEncoding.ALL_ONES,
    signed=False, has_zero=False,
    aliases=("float8_e8m0fnu", "e8m0fnu"), torch_dtype="float8_e8m0fnu",
    role="MX block scale: an unsigned power of two",
)

FORMATS: dict[str, FloatFormat] = {f.name: f for f in (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ, E3M2, E2M3, E2M1, E8M0)}
"""Every format by canonical name, in table order."""

_BY_ALIAS: dict[str, FloatFormat] = {
    key: f for f in FORMATS.values() for key in (f.name, *f.aliases)
}


def fnuz_scale_factor(ocp: FloatFormat, fnuz: FloatFormat) -> float:
    """The factor an ``fn`` code's value takes when its bits are read as the ``fnuz`` format of the
    same layout: ``2 ** (ocp.bias - fnuz.bias)`` (½ for E4M3 → E4M3FNUZ). Loading an OCP FP8
    checkpoint on fnuz hardware bit for bit means doubling its scales (and mapping 0x80, −0,
    to 0x00, since it is fnuz's NaN); AMD's stacks do exactly that.

    Example:
        >>> fnuz_scale_factor(E4M3, E4M3FNUZ), fnuz_scale_factor(E5M2, E5M2FNUZ)
        (0.5, 0.5)
    """
    if (ocp.exp_bits, ocp.man_bits) != (fnuz.exp_bits, fnuz.man_bits) or fnuz.nan is not NaNEncoding.NEG_ZERO:
        raise MinifloatError(f"{ocp.name} and {fnuz.name} do not share a bit layout with fnuz's reading")
    return 2.0 ** (ocp.bias - fnuz.bias)


def get_format(fmt: str | FloatFormat | torch.dtype) -> FloatFormat:
    """Look a format up by name, ml_dtypes / torch spelling, or torch dtype.

    Example:
        >>> get_format("float4_e2m1fn") is get_format("e2m1") is get_format(torch.float4_e2m1fn_x2)
        True
    """
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        key = str(fmt).removeprefix("torch.")
    elif isinstance(fmt, str):
        key = fmt.strip().lower()
    else:
        raise UnknownFormatError(
            f"a format is a name, a torch dtype or a FloatFormat, not {type(fmt).__name__} "
            f"{fmt!r}; known: {', '.join(FORMATS)}"
        )
    try:
        return _BY_ALIAS[key]
    except KeyError:
        raise UnknownFormatError(
            f"unknown format {fmt!r}; known: {', '.join(FORMATS)} "
            f"(or their ml_dtypes/torch names, e.g. float8_e4m3fn)"
        ) from None
