"""`minifloat formats --plot`: why E4M3 suits weights/activations and E5M2 gradients."""

from __future__ import annotations

import os

import torch

from minifloat.formats import FORMATS
from minifloat.formats.codec import decode, encode, value_table
from minifloat.io.atomic import atomic_path
from minifloat.report import require_matplotlib

ELEMENT_FORMATS = [f for f in FORMATS.values() if f.signed]  # E8M0 is a scale, not an element


def relative_error_envelope(fmt, lo: float = 1e-8, hi: float = 1e6, bins: int = 140, per_bin: int = 300):
    """Worst relative rounding error of `fmt` (saturating) in each of `bins` log-spaced bins."""
    x = torch.logspace(torch.log10(torch.tensor(lo)).item(), torch.log10(torch.tensor(hi)).item(),
                       bins * per_bin, dtype=torch.float64)
    err = (decode(encode(x, fmt), fmt, torch.float64) - x).abs() / x
    centers = x.view(bins, per_bin).log().mean(1).exp()
    return centers, err.view(bins, per_bin).amax(1)


def plot_formats(path: str | os.PathLike[str]) -> None:
    """Draw (a) relative rounding error vs magnitude and (b) the values near 1.0 to `path`."""
    plt = require_matplotlib()
    fig, (ax_err, ax_grid) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})

    for fmt in ELEMENT_FORMATS:
        centers, worst = relative_error_envelope(fmt)
        ax_err.loglog(centers.numpy(), worst.clamp_min(1e-4).numpy(), label=f"{fmt.name} (max {fmt.max:g})",
                      lw=2 if fmt.bits == 8 else 1.2)
    ax_err.set_ylim(5e-3, 2)
    ax_err.set_xlabel("|x|")
    ax_err.set_ylabel("worst relative rounding error")
    ax_err.set_title("(a) relative error vs magnitude (saturating, round to nearest)")
    ax_err.grid(True, which="major", alpha=0.3)
    ax_err.legend(loc="lower left", fontsize=8)
    ax_err.text(
        0.99, 0.02,
        "flat floor = precision (2^-(M+1)); left wall = underflow to 0;\n"
        "right wall = saturation at max.\n"
        "E4M3: half the error of E5M2 but only 2^-9..448: weights and\n"
        "activations, whose range a scale can fit. E5M2: 2^-16..57344,\n"
        "the range gradients span: gradients.",
        transform=ax_err.transAxes, ha="right", va="bottom", fontsize=8,
        bbox={"boxstyle": "round", "fc": "white", "alpha": 0.9},
    )

    for row, fmt in enumerate(ELEMENT_FORMATS):
        vals = value_table(fmt)
        vals = vals[torch.isfinite(vals) & (vals >= 0.25) & (vals <= 4)].unique()
        ax_grid.scatter(vals.numpy(), [row] * len(vals), marker="|", s=250)
        ax_grid.text(4.3, row, f"{fmt.values_in_1_2} in [1,2)", va="center", fontsize=8)
    ax_grid.set_xscale("log", base=2)
    ax_grid.set_xlim(0.22, 7)
    ax_grid.axvspan(1, 2, color="grey", alpha=0.1)
    ax_grid.set_yticks(range(len(ELEMENT_FORMATS)), [f.name for f in ELEMENT_FORMATS])
    ax_grid.set_ylim(-0.7, len(ELEMENT_FORMATS) - 0.3)
    ax_grid.set_xlabel("value")
    ax_grid.set_title("(b) representable values near 1.0")

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
