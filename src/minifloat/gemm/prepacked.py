"""`PackedWeight`: a weight prepacked for ``x · Wᵀ`` with a high-precision `x` (the shape of
fbgemm's ``linear_prepack``): made once from a `QuantizedTensor` by `prepack`, it holds what
each call would otherwise look up — which kernel serves a decode-sized call and that kernel's
plan of the weight (`minifloat.kernels.gemv.Plan`: addresses, geometry, decode tables).

Invariants: a call returns what ``weight_only_mm(x, w, backend=backend)`` returns, up to FP32
summation order; the plan is remade, before the call that would read it, when the weight's parts
have been written in place (their version counters) or a kernel was registered or removed since
(`registry_version`). ``MINIFLOAT_KERNELS=reference`` and the ISA path are read when the plan is made.

Example:
    >>> from minifloat import quantize
    >>> w = quantize(torch.randn(32, 64), "nvfp4")
    >>> packed = prepack(w)
    >>> x = torch.randn(1, 64)
    >>> torch.allclose(packed(x), x @ w.dequantize().t(), atol=1e-5), packed.decodes(x)
    (True, True)
"""

from __future__ import annotations

import os

import torch

from minifloat.gemm.weight_only import registry_version, weight_only_kernels, weight_only_mm
from minifloat.kernels import gemv
from minifloat.quant.tensor import QuantizedTensor

DECODE_ROWS = gemv.MAX_ROWS  # the most rows a decode-kernel call takes


class PackedWeight:
    """A `QuantizedTensor` prepacked for weight-only products; see the module docstring."""

    __slots__ = ("weight", "backend", "plan", "isa", "_made_under")

    def __init__(self, weight: QuantizedTensor, backend: str = "auto") -> None:
        self.weight, self.backend = weight, backend
        self._make()

    def _versions(self) -> tuple[int, ...]:
        return tuple(t._version for t in (self.weight.data, self.weight.scale, self.weight.tensor_scale) if t is not None)

    def _make(self) -> None:
        w = self.weight
        self._made_under = (registry_version(), self._versions())
        # the built-in decode kernel serves calls of ≤ DECODE_ROWS rows where the dispatch would pick
        # it: no other kernel registered ahead of it, the backend allows it, the kernels take W
        takes = (
            self.backend in ("auto", "native", "decode") and weight_only_kernels() == ["decode"]
            and w.device.type == "cpu" and os.environ.get("MINIFLOAT_KERNELS") != "reference"
            and gemv.supports(torch.empty(1, w.shape[1]), w.data, w.shape, w.scheme)
        )  # fmt: skip
        self.plan = gemv.Plan(w.data, w.scale, w.tensor_scale, w.shape, w.scheme) if takes else None
        self.isa = gemv.best_isa() if takes else None  # the path, chosen here: no environment read per call

    def current(self) -> bool:
        """Whether the plan still stands for the weight and the dispatch."""
        return self._made_under == (registry_version(), self._versions())

    def decodes(self, x: torch.Tensor) -> bool:
        """Whether a call with `x` goes to the decode kernel (a float CPU `x` of ≤ DECODE_ROWS rows)."""
        if not self.current():
            self._make()
        return (
            self.plan is not None and x.device.type == "cpu" and x.dim() == 2
            and 0 < x.shape[0] <= DECODE_ROWS and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x · Wᵀ`` in float32 for `x` (M, K)."""
        if self.decodes(x):
            return self.plan(x, self.isa)
        return weight_only_mm(x, self.weight, backend=self.backend)

    def __reduce__(self):
        """Copied or pickled as its weight (a plan holds addresses: the copy makes its own)."""
        return PackedWeight, (self.weight, self.backend)


def prepack(weight: QuantizedTensor, backend: str = "auto") -> PackedWeight:
    """`weight` prepacked for weight-only products by `backend` (see the module docstring)."""
    return PackedWeight(weight, backend)
