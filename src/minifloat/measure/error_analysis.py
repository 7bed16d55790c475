"""Quantization error figures: SQNR, relative L2, max error, saturation and underflow.

Example:
    >>> r = error_report(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)), "mxfp8")
    >>> 25 < r["sqnr_db"] < 40, r["bits_per_element"]
    (True, 8.25)
"""

from __future__ import annotations

import math

import torch

from minifloat.errors import MinifloatError
from minifloat.quant.api import quantize
from minifloat.scaling.layout import layout_for
from minifloat.scaling.schemes import Scheme, get_scheme


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10·log10(‖ref‖² / ‖ref − approx‖²) in float64 (inf when exact)."""
    ref, app = reference.double(), approx.double()
    noise = (ref - app).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _block_limits(q) -> torch.Tensor:
    """The largest magnitude each element's block can hold (element max × decode scale)."""
    lay = layout_for(q.shape, q.scheme)
    lim = (q.decode_scales().double() * q.scheme.element_format.max)[:, None, :, None]
    lim = lim.expand(*lay.tiles).reshape(lay.rows_pad, lay.cols_pad)
    return lim[: lay.rows, : lay.cols].reshape(q.shape)


def error_report(x: torch.Tensor, scheme: str | Scheme) -> dict[str, float | str]:
    """Error of quantizing `x` with `scheme`, over the finite elements of `x`.

    A NaN in `x` makes its whole block (row, tensor) dequantize to NaN; the finite elements it
    takes with it are counted in ``frac_nan`` and left out of the other figures.
    """
    scheme = get_scheme(scheme)
    if not x.numel():
        raise MinifloatError("error_report needs a non-empty tensor")
    q = quantize(x, scheme)
    d = q.dequantize(torch.float32)
    finite = torch.isfinite(x)
    lost = finite & torch.isnan(d)
    frac_nan = lost.double().sum().item() / max(int(finite.sum()), 1)
    finite &= ~lost
    xf, df = x.float()[finite].double(), d[finite].double()
    sizes = {"bits_per_element": q.bits_per_element, "memory_vs_fp16": q.nbytes / (2 * x.numel()), "frac_nan": frac_nan}
    errors = ("sqnr_db", "rel_l2", "max_abs_err", "frac_saturated", "frac_underflow")
    if not xf.numel():  # every finite element shares a block with a NaN: nothing left to measure
        return {"scheme": scheme.name, **dict.fromkeys(errors, math.nan), **sizes}
    err = (xf - df).abs()
    saturated = (xf.abs() > _block_limits(q)[finite] * (1 + 2**-20)) & (df.abs() < xf.abs())
    return {
        "scheme": scheme.name,
        "sqnr_db": sqnr_db(xf, df),
        "rel_l2": (err.norm() / xf.norm()).item() if xf.norm() > 0 else 0.0,
        "max_abs_err": err.max().item(),
        "frac_saturated": saturated.double().mean().item(),
        "frac_underflow": ((xf != 0) & (df == 0)).double().mean().item(),
        **sizes,
    }


def synthetic(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Test inputs: ``gaussian``, ``heavy`` (Student-t, 3 dof), ``outliers`` (Gaussian with
    1 % of rows scaled ×100, like LLM activation channels)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(rows, cols, generator=g)
    if kind == "heavy":
        z = torch.randn(rows, cols, generator=g)
        chi = torch.randn(rows, cols, 3, generator=g).pow(2).sum(-1)
        return z / torch.sqrt(chi / 3)
    if kind == "outliers":
        x = torch.randn(rows, cols, generator=g)
        idx = torch.randperm(rows, generator=g)[: max(1, rows // 100)]
        x[idx] *= 100
        return x
    raise MinifloatError(f"unknown input {kind!r}; use gaussian, heavy, outliers or a .safetensors file")
