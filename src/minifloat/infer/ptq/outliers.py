"""Outlier input channels kept in BF16 beside a quantized product (``keep_channels=K``): the
mixed-precision decomposition of LLM.int8() (arXiv 2208.07339) and QUIK (arXiv 2310.09259), on
FP8 / MX inputs.

A few input channels of a transformer's Linears carry most of the input's energy (massive
activations). Under a power-of-two block scale (MXFP8's E8M0) a block's largest value keeps E4M3's
4 significant bits, and its rounding error, multiplied by the weight column it meets, is most of
the layer's; under a per-row FP32 scale the same value would sit exactly on 448. So each layer
keeps its K input channels of largest calibration mean square (``diag H``, H = XᵀX / n) out of
the quantized product: ``y = Q(x_r) Q(W_r)ᵀ + bf16(x_k) bf16(W_k)ᵀ``, x_r the input with the kept
channels set to zero (they leave their blocks' scales too), W_r the weight with those columns zero.

GPTQ then rounds W_r knowing that the kept columns stay free: with the rest r and the kept k,
``min ‖X_r (W_r − Q_r)ᵀ + X_k (W_k − W_k')ᵀ‖²`` over W_k' gives ``W_k' = W_k + (W_r − Q_r) H_rk H_kk⁻¹``
and leaves ``(W_r − Q_r) S (W_r − Q_r)ᵀ``, S = H_rr − H_rk H_kk⁻¹ H_kr the Schur complement — the
Hessian GPTQ rounds W_r with (`condition`). Round to nearest keeps W_k as it is.

Example:
    >>> x = torch.randn(512, 8); x[:, 3] *= 100
    >>> h = x.T.double() @ x.double() / 512
    >>> choose_channels(h, 1).tolist()
    [3]
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError

KEPT_DTYPE = torch.bfloat16  # the kept channels' inputs and weights: a BF16 GEMM beside the quantized one


def check_count(count) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise MinifloatError(f"keep_channels takes a number of input channels ≥ 0 to keep in BF16 per layer, got "
                             f"{count!r} (0: none)")  # fmt: skip


def choose_channels(hessian: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` input channels of largest mean square (``diag`` of `hessian`), ascending (int64);
    channels never reached (mean square 0) are not chosen."""
    d = torch.diagonal(hessian.detach()).double().cpu()
    top = torch.topk(d, min(count, d.numel())).indices
    return torch.sort(top[d[top] > 0]).values


def condition(hessian: torch.Tensor, kept: torch.Tensor, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, G) for the kept channels `kept`: S (K, K) float64 the Schur complement of H_kk on the
    rest's rows and columns and zero on the kept ones (GPTQ rounds their zero columns to zero
    and spreads nothing over them), G (K, k) float64 ``H_·k H_kk⁻¹`` with zero rows on the kept
    (``W_k' = W_k + (W − Q) G``). H_kk is damped by `damp` of its mean diagonal."""
    h = hessian.detach().double().cpu()
    mask = torch.ones(h.shape[0], dtype=torch.bool)
    mask[kept] = False
    rest = mask.nonzero().squeeze(1)
    hkk = h[kept][:, kept]
    hkk = hkk + damp * torch.diagonal(hkk).mean() * torch.eye(len(kept), dtype=h.dtype)
    hrk = h[rest][:, kept]
    g_rest = torch.linalg.solve(hkk, hrk.T).T  # H_rk H_kk⁻¹ (H_kk symmetric)
    s = torch.zeros_like(h)
    s[rest[:, None], rest] = h[rest][:, rest] - g_rest @ hrk.T
    g = torch.zeros(h.shape[0], len(kept), dtype=h.dtype)
    g[rest] = g_rest
    return s, g


def split(weight: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`weight` (N, K) float32 with the kept columns zero: the part the quantized product holds."""
    w = weight.detach().float().clone()
    w[:, kept] = 0.0
    return w
