"""Random Hadamard transform (RHT) of NVIDIA's NVFP4 training recipe.

Both operands of the weight-gradient GEMM are multiplied, along the reduction dimension in
groups of 16, by the same orthogonal matrix ``T = diag(s) · H16 / 4`` (H16 the Sylvester
Hadamard matrix, s fixed random signs). Since ``T Tᵀ = I`` the product is unchanged in exact
arithmetic, ``(a T)(b T)ᵀ = a bᵀ``, while outliers are spread over their 16-element group
before quantization, which makes block scales tighter (arXiv 2509.25149 §4.2).

It is computed as a fast Walsh–Hadamard transform (log2 16 = 4 rounds of additions per
value, in a fixed order: `minifloat.kernels.reference.rht`), so it gives the same bits on every device, which a
16×16 matrix product (summation order up to the BLAS) would not.

Example:
    >>> a, b = torch.randn(3, 32), torch.randn(5, 32)
    >>> torch.allclose(rht(a, seed=0) @ rht(b, seed=0).T, a @ b.T, atol=1e-5)
    True
"""

from __future__ import annotations

import functools

import torch

from minifloat import kernels
from minifloat.errors import MinifloatError


def _check_size(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise MinifloatError(f"the Hadamard transform size must be a power of two, got {n}")


@functools.lru_cache(maxsize=8)
def _signs(n: int, seed: int) -> torch.Tensor:
    _check_size(n)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def hadamard_signs(n: int = 16, seed: int = 0) -> torch.Tensor:
    """The random signs s (float32 ±1) of the transform drawn from `seed`."""
    return _signs(n, seed).clone()


def hadamard_matrix(n: int = 16, seed: int = 0) -> torch.Tensor:
    """The orthogonal float32 matrix ``T = diag(signs) · H_n / sqrt(n)`` with signs drawn from
    `seed` (H_n the Sylvester Hadamard matrix): what `rht` multiplies each group by."""
    _check_size(n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester construction: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (_signs(n, seed).double()[:, None] * h / n**0.5).float()


def rht(x: torch.Tensor, seed: int = 0, n: int = 16) -> torch.Tensor:
    """Multiply each group of n along the last dim of `x` by ``T = diag(s) · H_n / sqrt(n)``,
    zero-padding it to a multiple of n (float32 out; the padded columns are kept so both
    operands agree). Computed as `minifloat.kernels.reference.rht` (the fast Walsh–Hadamard
    transform in a fixed order), by the CPU kernel where it applies."""
    _check_size(n)
    cols = x.shape[-1]
    pad = (-cols) % n
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return kernels.rht(xf.contiguous(), _signs(n, seed))
