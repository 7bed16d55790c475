"""High-precision baselines: how ``fp32`` / ``bf16`` / ``fp16`` compute their GEMMs on this
machine — the one place that decides it — and `RoundedLinear`, a BF16 / FP16 GEMM as the
hardware computes it (operands rounded to the dtype, FP32 accumulation).

``bf16`` runs under ``torch.autocast`` where the CPU has BF16 units (the real BF16 GEMM, FP32
accumulation), and as `RoundedLinear` elsewhere, where autocast would be a slow emulation;
``fp16`` is always `RoundedLinear` (no CPU here has FP16 matrix units torch uses).

Example:
    >>> layer = RoundedLinear(4, 2, bias=False)
    >>> layer.weight.data = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    >>> layer(torch.tensor([[1.0, 2.0**-9, 3.0, 0.0]])).tolist()  # 1 + 2**-9 rounds to 1 in BF16
    [[1.0, 3.0]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from minifloat.gemm.support import native_bf16_cpu
from minifloat.nn.convert import swap_modules

HIGH_PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def high_precision_gemm(precision: str) -> str:
    """How `precision` (one of `HIGH_PRECISIONS`) computes its GEMMs here: ``"fp32"``,
    ``"autocast"`` (torch.autocast on the CPU's BF16 units) or ``"rounded"`` (`RoundedLinear`)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if precision == "bf16" and native_bf16_cpu() else "rounded"


def describe(precision: str) -> str:
    """`high_precision_gemm` in words, for reports."""
    how = {
        "fp32": "FP32 operands, FP32 accumulation",
        "autocast": "BF16 operands (torch.autocast); weights, norms and optimizer in FP32",
        "rounded": f"{precision.upper()} operands (operands rounded to the dtype, FP32 accumulation); "
        "weights, norms and optimizer in FP32",
    }
    return how[high_precision_gemm(precision)]


def autocast(precision: str):
    """The context a forward pass of `precision` runs in: torch.autocast where it is the
    precision's GEMM, else nothing."""
    if high_precision_gemm(precision) == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_high_precision(model: torch.nn.Module, precision: str, keep: Callable[[str, torch.nn.Module], bool]) -> None:
    """Make `model`'s plain ``nn.Linear`` layers that `keep(fqn, module)` compute as `precision`
    does here (in place): `RoundedLinear` where that is its GEMM, else unchanged."""
    if high_precision_gemm(precision) != "rounded":
        return
    fqns = [fqn for fqn, m in model.named_modules() if type(m) is torch.nn.Linear and keep(fqn, m)]
    swap_modules(model, fqns, lambda old: RoundedLinear.from_linear(old, _DTYPES[precision]))


class _RoundedLinearFunction(torch.autograd.Function):
    """A GEMM on operands rounded to `dtype` with FP32 accumulation (BF16/FP16 emulation)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xr, wr = x.to(dtype).float(), weight.to(dtype).float()
        ctx.save_for_backward(xr, wr)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        out = xr @ wr.t()
        if bias is not None:
            out = out + bias.float()
        return out.to(dtype).float().to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        xr, wr = ctx.saved_tensors
        gr = g.to(ctx.dtype).float()
        g2 = gr.reshape(-1, gr.shape[-1])
        grad_x = (gr @ wr).to(ctx.dtype).float()
        grad_w = g2.t() @ xr.reshape(-1, xr.shape[-1])
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class RoundedLinear(torch.nn.Linear):
    """nn.Linear computing as a BF16/FP16 GEMM with FP32 accumulation would (weights stay FP32)."""

    rounding_dtype = torch.bfloat16

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype: torch.dtype) -> RoundedLinear:
        """A RoundedLinear sharing `linear`'s Parameters (tied weights stay tied)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        new.weight, new.bias, new.rounding_dtype = linear.weight, linear.bias, dtype
        return new

    def forward(self, x):
        return _RoundedLinearFunction.apply(x, self.weight, self.bias, self.rounding_dtype)
