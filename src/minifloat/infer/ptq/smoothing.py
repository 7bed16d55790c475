"""Smoothing (SmoothQuant, arXiv 2211.10438) for W8A8 / W4A4: per input channel j a factor
``s_j = max|X_j|^α / max|W_j|^(1-α)`` (max|W_j| over every row of the Linears that share the
input) moved from the activations to the weights — ``(x / s)(W · diag(s))ᵀ = x Wᵀ`` — so that
an outlier channel of the input, which a shared block scale cannot hold, is tamed before both
are quantized (α = 0.5 by default; α = 0 only flattens the weights, 1 only the inputs).

The division by s is folded into the norm whose output the Linears alone read (a LayerNorm's
or RMSNorm's weight and bias divided by s, Gemma's ``(1 + w)`` as a whole: q/k/v after the
attention norm, gate/up after the MLP norm) and applied online otherwise (`Smoothing`, a multiply by 1/s before the input is quantized).

Example:
    >>> s = smoothing_factors(torch.tensor([4.0, 1.0]), [torch.tensor([[1.0, 1.0]])], alpha=0.5)
    >>> s.tolist()
    [2.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minifloat.errors import MinifloatError

MIN_FACTOR = 1e-5  # a channel never seen (max|X| = 0) or an all-zero weight column: no division by ~0


def check_alpha(alpha: float | None) -> float | None:
    if alpha is not None and not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise MinifloatError(f"smoothing α is in [0, 1] (0.5: SmoothQuant's default); got {alpha!r}")
    return None if alpha is None else float(alpha)


def smoothing_factors(input_amax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """Per input channel, s (float32, K): `input_amax` the calibrated max|X_j| (K,), `weights`
    the (N_i, K) weights that read that input."""
    w_amax = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0)
    x_amax = input_amax.float()
    s = x_amax.clamp_min(MIN_FACTOR).pow(alpha) / w_amax.clamp_min(MIN_FACTOR).pow(1 - alpha)
    return torch.where((x_amax > 0) & (w_amax > 0), s.clamp_min(MIN_FACTOR), 1.0)


class Smoothing(torch.nn.Module):
    """``x → x / s`` online (a buffer ``inverse`` = 1/s, float32)."""

    def __init__(self, factors: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inverse", 1.0 / factors.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.inverse).to(x.dtype)


def weight_offset(norm: torch.nn.Module) -> float | None:
    """c where `norm` computes normalize(x) · (c + weight) (+ bias): 0 for Llama's RMSNorm and a
    LayerNorm, 1 for Gemma's ``(1 + w)``; None when it is neither (found by running it once with its
    weight at zero on a ±1 input, which either normalization leaves as it is)."""
    weight = norm.weight
    x = torch.ones(1, weight.numel(), dtype=weight.dtype, device=weight.device)
    x[..., 1::2] = -1
    if weight.numel() % 2:
        return None
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.zero_()
            out = norm(x).float()
    except Exception:  # noqa: BLE001 - a module that is not a plain norm: not foldable
        return None
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    c = float((out * x.float()).mean())  # a bias cancels: x sums to zero
    return float(round(c)) if round(c) in (0, 1) and abs(c - round(c)) < 1e-2 else None


def fold_into_norm(norm: torch.nn.Module, factors: torch.Tensor) -> bool:
    """Divide the output of `norm` (a LayerNorm / RMSNorm with an elementwise weight over the
    last dim, Gemma's ``(1 + w)`` one too: w ← (1 + w) / s − 1) by `factors`, in place; False
    when it has no such weight."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or weight.numel() != factors.numel():
        return False
    if "norm" not in type(norm).__name__.lower():
        return False
    c = weight_offset(norm)
    if c is None:
        return False
    with torch.no_grad():
        f = factors.to(torch.float32)
        weight.copy_(((c + weight.float()) / f - c).to(weight.dtype))
        bias = getattr(norm, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.div_(factors.to(bias.dtype))
    return True
