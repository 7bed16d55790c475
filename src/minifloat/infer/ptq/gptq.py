"""GPTQ (Frantar et al., arXiv 2210.17323) on every FP weight grid: the columns of a weight
rounded one at a time, each rounding error spread over the columns not yet rounded so that the
layer's output on its calibration inputs changes least.

With ``H = XᵀX / n`` the second moment of the layer's inputs (`HessianObserver`), damped by
``damp · mean(diag H)`` on the diagonal, and ``U`` the upper Cholesky factor of ``H⁻¹``: column j
is rounded to ``q_j``, and every later column k gets ``W[:, k] -= (w_j - q_j) / U[j, j] · U[j, k]``
(in blocks of `block_size` columns, the later blocks updated once per block — the paper's lazy
batch updates, the same arithmetic).

The block scales are fixed before any column is rounded, from the original weight, by a scale
observer (`minifloat.infer.ptq.scales`): each column is rounded to nearest on its own block's grid,
so the result is an ordinary `QuantizedTensor` of the scheme (exported and served as round to
nearest's). With ``act_order`` the columns go in order of decreasing ``diag H`` (static
activation order: a column keeps the scale of its own block, wherever it goes in the order). A
column whose input was always zero (``H[j, j] = 0``) is rounded to nearest and its weight kept.
With an identity Hessian nothing is spread, and GPTQ is round to nearest on the same scales.

Asymmetric calibration (`GPTQConfig.asymmetric`; the target of GPTAQ, arXiv 2504.02692): GPTQ
above keeps each layer's output on the inputs ``X`` that the quantized layers before it produce
— close to ``X Wᵀ``, the layer's own output on them, not to ``X_ref Wᵀ``, the full-precision
model's, which is what the model should still compute. With ``C = (X_ref − X)ᵀ X / n`` measured
on the same calibration rows, `refit` first moves the weight to the least-squares fit of the
full-precision output, ``W* = W + W C (H + λ I)⁻¹`` (a ridge λ = `asymmetric` · mean(diag H)
shrinks it toward W: the fit has K unknowns per row and only the calibration rows to fit them
on), then GPTQ rounds ``W*`` with ``H`` as above. At λ = 0 this minimizes ``‖X_ref Wᵀ − X Ŵᵀ‖²``
column by column as GPTQ does its own objective: ``‖X_ref Wᵀ − X Ŵᵀ‖² = ‖X_ref Wᵀ − X W*ᵀ‖² +
‖X (W* − Ŵ)ᵀ‖²``, the least-squares residual being orthogonal to X.

Example:
    >>> from minifloat.quant import block_scales
    >>> w, x = torch.randn(32, 64), torch.randn(256, 64)
    >>> q = gptq(w, x.T.double() @ x.double() / 256, "mxfp4", block_scales(w, "mxfp4"))
    >>> q.shape, q.scheme.name
    (torch.Size([32, 64]), 'mxfp4')
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import decode, encode_with_bits
from minifloat.formats.packing import pack
from minifloat.quant import BlockScales, QuantizedTensor
from minifloat.scaling.layout import Layout, layout_for
from minifloat.scaling.schemes import Scheme, get_scheme

ROWS_AT_ONCE = 4096  # weight rows rounded together (rounded down to whole scale blocks): bounds GPTQ's working memory


@dataclass(frozen=True, kw_only=True)
class GPTQConfig:
    """GPTQ's options: `damp` (the fraction of the mean Hessian diagonal added to it), columns
    rounded per lazy update (`block_size`), static activation order (`act_order`), asymmetric
    calibration (`asymmetric`: the ridge of `refit`, a fraction of the mean Hessian diagonal;
    None: off, GPTQ's own objective)."""

    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    asymmetric: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.damp, (int, float)) and 0 <= self.damp < 1e3):
            raise MinifloatError(f"GPTQ damp is a fraction of the mean Hessian diagonal, ≥ 0 (default 0.01); got {self.damp!r}")
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise MinifloatError(f"GPTQ block_size is a number of columns ≥ 1 (default 128); got {self.block_size!r}")
        a = self.asymmetric
        if a is not None and not (isinstance(a, (int, float)) and not isinstance(a, bool) and 0 < a <= 1e3):
            raise MinifloatError(f"GPTQ's asymmetric ridge is a fraction of the mean Hessian diagonal, > 0 (1 measured "
                                 f"best; None: off); got {a!r}")  # fmt: skip


def _spread(grid: torch.Tensor, n: int, k: int, lay: Layout) -> torch.Tensor:
    """Rows of a per-block tensor (the scale grid, from a block boundary) spread over the (n, k)
    elements their blocks cover."""
    return grid.repeat_interleave(lay.block_rows, 0).repeat_interleave(lay.block_cols, 1)[:n, :k]


def _round_rows(w: torch.Tensor, enc: torch.Tensor, dec: torch.Tensor, u: torch.Tensor, fmt, block_size: int) -> torch.Tensor:
    """The codes of rows `w` (columns in GPTQ's order, `w` overwritten), `enc` / `dec` their
    per-element scales in that order, `u` the upper Cholesky factor of ``H⁻¹`` in that order."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1, u1 = w[:, i1:i2].clone(), u[i1:i2, i1:i2]
        errors = torch.zeros(n, i2 - i1)
        for i in range(i2 - i1):
            col = w1[:, i]
            c = encode_with_bits(col * enc[:, i1 + i], fmt, saturate=True, canonical_nan=True)
            codes[:, i1 + i] = c
            err = (col - decode(c, fmt) * dec[:, i1 + i]) / u1[i, i]
            w1[:, i:] -= err[:, None] * u1[i, i:][None, :]
            errors[:, i] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    return codes


def _inverse_factor(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """The upper Cholesky factor of the damped ``H⁻¹`` (float64), or an error naming the fix."""
    h = h + damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    lower, info = torch.linalg.cholesky_ex(h)
    if info == 0:
        u, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
        if info == 0:
            return u
    raise MinifloatError(f"GPTQ: the Hessian of {name} is singular after damping {damp} of its mean diagonal; "
                         f"raise damp (default 0.01) or calibrate on more text")  # fmt: skip


def refit(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor, ridge: float, *,
          name: str = "the layer") -> torch.Tensor:
    """``W* = W + W C (H + λ I)⁻¹`` (float32 (N, K)), λ = `ridge` · mean(diag H): the weight whose
    output on the inputs seen, X (``hessian`` H = XᵀX / n), is closest to `weight`'s output on
    the full-precision model's inputs of the same rows, X_ref (``cross`` C = (X_ref − X)ᵀ X / n),
    with ``λ ‖W* − W‖²`` added to the squared error (module docstring)."""
    k = weight.shape[1]
    if tuple(hessian.shape) != (k, k) or tuple(cross.shape) != (k, k):
        raise MinifloatError(f"asymmetric GPTQ: {name}'s weight takes {k} inputs; its statistics are "
                             f"{tuple(hessian.shape)} and {tuple(cross.shape)}")  # fmt: skip
    h, c = hessian.detach().double().cpu(), cross.detach().double().cpu()
    if not (torch.isfinite(h).all() and torch.isfinite(c).all()):
        raise MinifloatError(f"asymmetric GPTQ: the statistics of {name}'s inputs hold a NaN or inf; check the calibration inputs")
    lam = float(ridge) * float(torch.diagonal(h).mean())
    if not lam > 0:  # no input ever reached it: nothing to fit
        return weight.detach().float()
    lower, info = torch.linalg.cholesky_ex(h + lam * torch.eye(k, dtype=h.dtype))
    if info != 0:
        raise MinifloatError(f"asymmetric GPTQ: the Hessian of {name} is singular after a ridge of {ridge}; raise it")
    w = weight.detach().double().cpu()
    # (W C (H + λI)⁻¹)ᵀ = (H + λI)⁻¹ Cᵀ Wᵀ: H + λI is symmetric
    return (w + torch.cholesky_solve(c.T @ w.T, lower).T).float()


def gptq(weight: torch.Tensor, hessian: torch.Tensor, scheme: str | Scheme, scales: BlockScales, *,
         config: GPTQConfig = GPTQConfig(), name: str = "the layer") -> QuantizedTensor:  # noqa: B008 - frozen  # fmt: skip
    """`weight` (N, K) quantized by GPTQ on `scheme`'s grid with the fixed block `scales`, the
    input second moment `hessian` (K, K) weighing the errors; see the module docstring."""
    scheme = get_scheme(scheme)
    if weight.dim() != 2:
        raise MinifloatError(f"GPTQ quantizes a 2-D weight (out_features, in_features); {name}'s is {tuple(weight.shape)}")
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise MinifloatError(f"GPTQ: the Hessian of {name} is {tuple(hessian.shape)}, its weight takes {k} inputs")
    w = weight.detach().float()  # read only: each chunk of rows is a reordered copy
    if not torch.isfinite(w).all():
        raise MinifloatError(f"GPTQ: the weight of {name} holds a NaN or inf; GPTQ spreads errors over the row, "
                             f"so it needs finite weights (keep the layer in high precision, or use method='rtn')")  # fmt: skip
    h = hessian.detach().double().cpu().clone()
    if not torch.isfinite(h).all():
        raise MinifloatError(f"GPTQ: the Hessian of {name} holds a NaN or inf; check the calibration inputs")
    fmt = scheme.element_format
    diag = torch.diagonal(h)
    dead = diag == 0  # an input always zero: nothing to weigh its error by
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if config.act_order else torch.arange(k)
    u = _inverse_factor(h[order][:, order], float(config.damp), name).float()
    # rows are independent (each row's errors go to its own later columns): round them in chunks of
    # whole scale blocks, so the working copies hold ROWS_AT_ONCE rows, not the whole weight (an LM head)
    lay = layout_for((n, k), scheme)
    step = max(1, ROWS_AT_ONCE // lay.block_rows) * lay.block_rows
    enc_grid, dec_grid = scales.encode.float(), scales.decode(scheme).float()
    codes = torch.zeros(lay.rows_pad, lay.cols_pad, dtype=torch.uint8)  # the layout's padding: code 0, +0
    back = torch.argsort(order)
    for r in range(0, n, step):
        rows = min(step, n - r)
        grid = slice(r // lay.block_rows, -(-(r + rows) // lay.block_rows))
        enc = _spread(enc_grid[grid], rows, k, lay)[:, order]
        dec = _spread(dec_grid[grid], rows, k, lay)[:, order]
        codes[r : r + rows, :k] = _round_rows(w[r : r + rows, order], enc, dec, u, fmt, config.block_size)[:, back]
    data = pack(codes, fmt).view(lay.rows_pad, lay.cols_pad * fmt.bits // 8)  # as `quantize` packs its codes
    return QuantizedTensor(data, scales.scale, scales.tensor_scale, weight.shape, scheme, weight.dtype)
