"""Hadamard rotations of a Linear's input (``rotation="hadamard:N"``): block-diagonal, N wide,
applied to the input online by a fast Walsh–Hadamard transform (`minifloat.quant.rht`, no
matrix) and folded into the weight offline, as MR-GPTQ does (arXiv 2509.23202).

Each group of N inputs is multiplied by the orthogonal ``T = diag(s) · H_N / sqrt(N)`` (random
signs s from a fixed seed): ``(x T)(W T)ᵀ = x Wᵀ`` in exact arithmetic, while an outlier of x or
of a weight row is spread over its N-wide group before either is quantized — the groups of
MXFP4 / NVFP4 (32, 16) see flatter values. N must divide in_features (no padding is stored).

Example:
    >>> r = HadamardRotation(32)
    >>> x, w = torch.randn(4, 64), torch.randn(8, 64)
    >>> torch.allclose(r(x) @ r.fold(w).T, x @ w.T, atol=1e-5)
    True
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.quant import rht

ROTATION_SIZES = (16, 32, 64, 128)


def parse_rotation(spec: str | None) -> int | None:
    """The size N of ``"hadamard:N"`` (None for None or ``"none"``), or a clear error."""
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return None
    kind, _, size = str(spec).strip().lower().partition(":")
    if kind != "hadamard" or not size.isdigit() or int(size) not in ROTATION_SIZES:
        raise MinifloatError(f"unknown rotation {spec!r}; use hadamard:N with N in {', '.join(map(str, ROTATION_SIZES))}, or none")
    return int(size)


class HadamardRotation(torch.nn.Module):
    """``x → x T`` per N-wide group of the last dim (module docstring); `fold` gives ``W T``."""

    def __init__(self, size: int, seed: int = 0) -> None:
        super().__init__()
        if size not in ROTATION_SIZES:
            raise MinifloatError(f"Hadamard rotation size {size} is not one of {', '.join(map(str, ROTATION_SIZES))}")
        self.size, self.seed = size, seed

    def check(self, in_features: int, name: str = "the layer") -> None:
        if in_features % self.size:
            fits = [n for n in ROTATION_SIZES if in_features % n == 0]
            raise MinifloatError(f"rotation hadamard:{self.size} does not divide {name}'s {in_features} inputs; "
                                 + (f"use hadamard:{fits[-1]}" if fits else "no Hadamard size divides it: use no rotation"))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x.shape[-1])
        return rht(x, seed=self.seed, n=self.size).to(x.dtype)

    def fold(self, weight: torch.Tensor) -> torch.Tensor:
        """``W T`` (float32): the weight that multiplies the rotated input."""
        return rht(weight.float(), seed=self.seed, n=self.size)

    def extra_repr(self) -> str:
        return f"hadamard:{self.size}, seed={self.seed}"
