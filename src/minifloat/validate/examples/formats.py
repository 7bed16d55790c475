"""The formats' table, and each codec checked against the published formula: every code decoded,
and random values encoded to their nearest representable value (ties to even), found by brute
force over the formula's values."""

from __future__ import annotations

import math

import torch

from minifloat.formats import FORMATS, decode, encode
from minifloat.formats.registry import NaNEncoding
from minifloat.validate.runner import Check, Context, Outcome, phased

NAME, TITLE = "formats", "Formats and codec bit-exactness"
ELEMENTS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e8m0")


def formula(fmt, code: int) -> float:
    """The value of `code` by the format's definition (sign, biased exponent, fraction)."""
    sign = -1.0 if fmt.signed and code & fmt.sign_mask else 1.0
    mag = code & fmt.magnitude_mask
    e, f = mag >> fmt.man_bits, mag & ((1 << fmt.man_bits) - 1)
    if fmt.nan is NaNEncoding.IEEE and e == (1 << fmt.exp_bits) - 1:
        return sign * math.inf if f == 0 and fmt.has_inf else math.nan
    if fmt.nan is NaNEncoding.ALL_ONES and mag == fmt.magnitude_mask:
        return math.nan
    if fmt.has_zero and e == 0:
        return sign * f / 2**fmt.man_bits * 2.0 ** (1 - fmt.bias)
    return sign * (1 + f / 2**fmt.man_bits) * 2.0 ** (e - fmt.bias)


def nearest(values: list[tuple[float, int]], x: float) -> float:
    """The representable value nearest x; a tie goes to the even code (its last mantissa bit 0)."""
    best = min(values, key=lambda vc: (abs(vc[0] - x), vc[1] & 1))
    return best[0]


def run(ctx: Context) -> Outcome:
    out = Outcome()
    samples = ctx.pick({"tiny": 200, "default": 5000, "full": 20000})
    g = torch.Generator().manual_seed(0)
    for name in ELEMENTS:
        fmt = FORMATS[name]
        codes = torch.arange(fmt.num_codes, dtype=torch.uint8)
        got = phased("dequantize", decode, codes, fmt).double().tolist()
        want = [formula(fmt, c) for c in range(fmt.num_codes)]
        bad_decode = sum(not (a == b or (math.isnan(a) and math.isnan(b))) for a, b in zip(got, want, strict=True))
        finite = sorted({(v, c) for c, v in enumerate(want) if math.isfinite(v)})
        # values inside the range (saturation is a separate, documented choice)
        lo, hi = (min(v for v, _ in finite), max(v for v, _ in finite))
        x = (torch.rand(samples, generator=g, dtype=torch.float64) * (hi - lo) + lo)
        if name != "e8m0":  # many values near zero too, where the subnormals are
            x[: samples // 2] *= torch.rand(samples // 2, generator=g, dtype=torch.float64) ** 8
        x = x.float()
        enc = phased("quantize", encode, x, fmt)
        dec = decode(enc, fmt).double().tolist()
        bad_encode = sum(a != nearest(finite, v) for a, v in zip(dec, x.double().tolist(), strict=True))
        out.rows.append({"format": name, "bits": fmt.bits, "max": fmt.max, "min_normal": fmt.min_normal,
                         "min_subnormal": fmt.min_subnormal if fmt.has_subnormals else None,
                         "codes": fmt.num_codes, "decode_mismatches": bad_decode, "encode_mismatches": bad_encode,
                         "encode_samples": samples})  # fmt: skip
        out.checks.append(Check(f"{name}: codes decoded unlike the formula", bad_decode, 0, "==" ))
        out.checks.append(Check(f"{name}: encodings not the nearest value (of {samples})", bad_encode, 0, "=="))
        out.tensor_bytes += x.nbytes + enc.nbytes
    xs = torch.randn(1 << 16, generator=g)
    out.trace = {f"encode {n}": (lambda n=n: decode(encode(xs, n), n)) for n in ELEMENTS}
    return out
