"""Random Hadamard transform (RHT) of NVIDIA's NVFP4 training recipe.

Both operands of the weight-gradient GEMM are multiplied, along the reduction dimension in
groups of 16, by the same orthogonal matrix ``T = diag(s) · H16 / 4`` (H16 the Sylvester
Hadamard matrix, s fixed random signs). Since ``T Tᵀ = I`` the product is unchanged in exact
arithmetic, ``(a T)(b T)ᵀ = a bᵀ``, while outliers are spread over their 16-element group
before quantization, which makes block scales tighter (arXiv 2509.25149 §4.2).

Example:
    >>> a, b = torch.randn(3, 32), torch.randn(5, 32)
    >>> t = hadamard_matrix(16, seed=0)
    >>> torch.allclose(rht(a, t) @ rht(b, t).T, a @ b.T, atol=1e-5)
    True
"""

from __future__ import annotations

import functools

import torch

from minifloat.errors import MinifloatError


@functools.lru_cache(maxsize=8)
def _hadamard_signed(n: int, seed: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise MinifloatError(f"the Hadamard transform size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester construction: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return (signs[:, None] * h / n**0.5).float()


def hadamard_matrix(n: int = 16, seed: int = 0) -> torch.Tensor:
    """The orthogonal float32 matrix ``diag(signs) · H_n / sqrt(n)`` with signs drawn from `seed`."""
    return _hadamard_signed(n, seed).clone()


def rht(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Apply `t` (n×n) to each group of n along the last dim of `x`, zero-padding it to a
    multiple of n (float32 out; the padded columns are kept so both operands agree)."""
    n = t.shape[0]
    cols = x.shape[-1]
    pad = (-cols) % n
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    # One 2-D GEMM over all groups (a batched matmul of 16×16 blocks loops per block on CPU).
    return (xf.reshape(-1, n) @ t.to(xf.device)).reshape(*xf.shape[:-1], cols + pad)
