"""Quantization schemes: element format + granularity + scale format, as frozen values.

A scheme is data, built by name (`get_scheme("mxfp4")`) or by hand
(`Scheme(element="e4m3", granularity="block", block=(1, 64))`), validated once, and
serialisable to JSON so a report can record exactly what ran.

Granularities (on the 2-D view ``(rows, K)`` of a tensor, rows = all leading dims):

- ``tensor``: one scale; ``row``: one scale per row;
- ``block``: tiles of ``block = (block_rows, block_cols)`` elements — ``(1, 128)`` for
  DeepSeek-V3 activations, ``(128, 128)`` for its weights, ``(1, 32)`` for MX, ``(1, 16)``
  and ``(16, 16)`` for NVFP4.

Example:
    >>> s = get_scheme("mxfp4")
    >>> s.element, s.block, s.scale_format, s.bits_per_element
    ('e2m1', (1, 32), 'e8m0', 4.25)
    >>> get_scheme("fp8_block128x128").block
    (128, 128)
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

from minifloat.errors import MinifloatError
from minifloat.formats.registry import FloatFormat, get_format
from minifloat.naming import lookup

GRANULARITIES = ("tensor", "row", "block")
SCALE_FORMATS = ("fp32", "e8m0", "e4m3")  # e4m3 = NVFP4's E4M3 block scale + FP32 tensor scale
SCALE_RULES = ("floor", "rceil", "least-error", "4over6")  # least-error: MX only; 4over6: NVFP4 only
_SCALE_BITS = {"fp32": 32, "e8m0": 8, "e4m3": 8}
MAX_MARGIN = 126  # 2**-margin stays a normal float32


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """How to quantize a tensor. See the module docstring for the fields' meaning.

    Attributes:
        name: preset name, or ``"custom"``.
        element: element format name.
        granularity: ``"tensor"``, ``"row"`` or ``"block"``.
        block: ``(block_rows, block_cols)`` for ``granularity="block"``.
        scale_format: ``"fp32"``, ``"e8m0"`` (MX) or ``"e4m3"`` (NVFP4 two-level).
        scale_rule: E8M0 rule, ``"floor"`` (OCP MX), ``"rceil"`` (NVIDIA) or ``"least-error"``: per
            block, the floor exponent, or the next one up where the floor clips the block's
            amax, whichever quantizes the block with the smaller squared error; for NVFP4,
            ``"4over6"`` picks per block the block scale that maps the block's amax to 6 or
            to 4, whichever quantizes the block with the smaller squared error ("Four Over
            Six", arXiv 2512.02010); the default leaves NVFP4 as NVIDIA defines it.
        margin: FP32 scales only: ``scale = max / (amax · 2**margin)``.
        rounding: ``"nearest"`` or ``"stochastic"`` for the elements.
    """

    name: str = "custom"
    element: str
    granularity: str = "tensor"
    block: tuple[int, int] | None = None
    scale_format: str = "fp32"
    scale_rule: str = "floor"
    margin: int = 0
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        fmt = get_format(self.element)  # raises UnknownFormatError with the known names
        object.__setattr__(self, "element", fmt.name)
        if not fmt.signed:
            raise MinifloatError(f"{fmt.name} is a scale format, not an element format")
        if self.granularity not in GRANULARITIES:
            raise MinifloatError(f"unknown granularity {self.granularity!r}; use one of {', '.join(GRANULARITIES)}")
        if self.scale_format not in SCALE_FORMATS:
            raise MinifloatError(f"unknown scale format {self.scale_format!r}; use one of {', '.join(SCALE_FORMATS)}")
        if self.scale_rule == "mse":  # the rule's earlier name; "mse" names the PTQ scale observer (a search)
            raise MinifloatError("scale rule 'mse' is now 'least-error' (per block, the floor E8M0 exponent or the one "
                                 "above, whichever errs less); 'mse' names the PTQ scale observer, a wider search")
        if self.scale_rule not in SCALE_RULES:
            raise MinifloatError(f"unknown scale rule {self.scale_rule!r}; use 'floor', 'rceil' or 'least-error' (MX), or '4over6' (NVFP4)")
        if self.scale_rule == "4over6" and self.scale_format != "e4m3":
            raise MinifloatError("scale_rule='4over6' chooses NVFP4 block scales; it needs scale_format='e4m3'")
        if self.scale_rule == "least-error" and self.scale_format != "e8m0":
            raise MinifloatError("scale_rule='least-error' chooses MX (E8M0) block scales; it needs scale_format='e8m0'")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or abs(self.margin) > MAX_MARGIN:
            raise MinifloatError(
                f"margin must be a whole number of binades in [-{MAX_MARGIN}, {MAX_MARGIN}] (scale / 2**margin), "
                f"got {self.margin!r}"
            )
        if self.rounding not in ("nearest", "stochastic"):
            raise MinifloatError(f"unknown rounding {self.rounding!r}; use 'nearest' or 'stochastic'")
        if self.granularity == "block":
            object.__setattr__(self, "block", _block(self.block))
            if self.block[1] * fmt.bits % 8:
                raise MinifloatError(
                    f"a block of {self.block[1]} {fmt.name} elements is not whole bytes; "
                    f"use a multiple of {8 // _gcd8(fmt.bits)} columns"
                )
        elif self.block is not None:
            raise MinifloatError(f"block={self.block!r} only goes with granularity='block'")
        if self.scale_format != "fp32" and self.granularity != "block":
            raise MinifloatError(f"{self.scale_format} scales are per block; use granularity='block'")
        if self.scale_format == "e4m3" and fmt.name != "e2m1":
            raise MinifloatError("the NVFP4 two-level scale (scale_format='e4m3') is defined for e2m1 elements")

    @property
    def element_format(self) -> FloatFormat:
        return get_format(self.element)

    @property
    def bits_per_element(self) -> float:
        """Element bits + block-scale bits per element (per-tensor scalars not counted;
        for row scales the row length is unknown here, see QuantizedTensor.bits_per_element)."""
        bits = float(self.element_format.bits)
        if self.granularity == "block":
            bits += _SCALE_BITS[self.scale_format] / (self.block[0] * self.block[1])
        return bits

    @property
    def is_mx(self) -> bool:
        return self.scale_format == "e8m0"

    @property
    def is_nvfp4(self) -> bool:
        return self.scale_format == "e4m3"

    def replace(self, **changes) -> Scheme:
        """A copy with `changes` (a preset keeps its name only if nothing changed)."""
        changes.setdefault("name", "custom")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["block"] = list(self.block) if self.block else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Scheme:
        try:  # a JSON list for block is fine: __post_init__ makes it a tuple
            return cls(**d)
        except TypeError as err:
            raise MinifloatError(f"not a scheme description: {err}") from None


def _block(block: object) -> tuple[int, int]:
    """`block` as two whole numbers ≥ 1 (ints, or NumPy / torch integers), else a clear error:
    32.5 is not truncated to 32."""
    try:
        rows, cols = block
        if not isinstance(rows, bool) and not isinstance(cols, bool):
            rows, cols = operator.index(rows), operator.index(cols)
            if min(rows, cols) >= 1:
                return rows, cols
    except (TypeError, ValueError):
        pass
    raise MinifloatError(f"block granularity needs block=(rows, cols), two whole numbers ≥ 1, got {block!r}")


def _gcd8(bits: int) -> int:
    import math

    return math.gcd(bits, 8)


def _mx(name: str, element: str) -> Scheme:
    return Scheme(name=name, element=element, granularity="block", block=(1, 32), scale_format="e8m0")


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(name="fp8", element="e4m3"),
        Scheme(name="fp8_e5m2", element="e5m2"),
        Scheme(name="fp8_rowwise", element="e4m3", granularity="row"),
        Scheme(name="fp8_block128", element="e4m3", granularity="block", block=(1, 128)),
        Scheme(name="fp8_block128x128", element="e4m3", granularity="block", block=(128, 128)),
        _mx("mxfp8", "e4m3"),
        _mx("mxfp8_e5m2", "e5m2"),
        _mx("mxfp6_e3m2", "e3m2"),
        _mx("mxfp6_e2m3", "e2m3"),
        _mx("mxfp4", "e2m1"),
        Scheme(name="nvfp4", element="e2m1", granularity="block", block=(1, 16), scale_format="e4m3"),
        Scheme(name="nvfp4_2d", element="e2m1", granularity="block", block=(16, 16), scale_format="e4m3"),
        Scheme(name="fp6_e3m2", element="e3m2"),
        Scheme(name="fp4", element="e2m1"),
        Scheme(name="fp8_fnuz", element="e4m3fnuz"),  # AMD's FP8 (MI300)
        Scheme(name="fp8_e5m2fnuz", element="e5m2fnuz"),
        Scheme(name="fp8_rowwise_fnuz", element="e4m3fnuz", granularity="row"),
    )
}
"""Every named preset."""


def get_scheme(scheme: str | Scheme) -> Scheme:
    """A preset by name, or `scheme` itself.

    Example:
        >>> get_scheme("nvfp4").bits_per_element
        4.5
    """
    if isinstance(scheme, Scheme):
        return scheme
    if isinstance(scheme, str):
        return lookup(SCHEMES, scheme, "scheme")
    raise MinifloatError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")


def named(scheme: Scheme) -> Scheme:
    """The preset equal to `scheme` in every field but its name, else `scheme` itself.

    Example:
        >>> named(get_scheme("mxfp8").replace(element="e2m1")).name
        'mxfp4'
    """
    for preset in SCHEMES.values():
        if dataclasses.replace(preset, name=scheme.name) == scheme:
            return preset
    return scheme
