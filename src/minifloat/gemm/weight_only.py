"""`weight_only_mm`: ``x · Wᵀ`` for a high-precision input `x` and a packed weight `W` — the one
dispatch every weight-only Linear goes through, where decode kernels plug in.

A kernel is registered with `register_weight_only_kernel(name, supports, fn)` (and removed with
`unregister_weight_only_kernel(name)`): `supports(x, w)` says whether it takes this input and
weight (device, scheme, shapes), `fn(x, w)` returns the float32 product. ``backend="auto"`` takes the most recently registered kernel that supports the
call (a user's before the built-in one), and the reference otherwise; a name asks for that
kernel (a clear error where it does not apply);
``"emulated"`` is the reference: the weight dequantized exactly (codes × scales, float32) and a
float32 GEMM, so every kernel must equal it up to summation order.

One kernel is registered here: ``"decode"`` (`minifloat.kernels.gemv`), the C kernels that read
the packed codes and scales in place for up to 16 rows of x on a CPU (a decode step, a
speculative verification); prefill and training (more rows) take the reference. A Linear that
calls it every token holds its weight prepacked (`minifloat.gemm.prepacked.prepack`): the
kernel's arguments made once, not per call.

Example:
    >>> from minifloat import quantize
    >>> w = quantize(torch.randn(8, 64), "nvfp4")
    >>> x = torch.randn(3, 64)
    >>> torch.equal(weight_only_mm(x, w, backend="emulated"), x @ w.dequantize().t())
    True
    >>> torch.allclose(weight_only_mm(x, w), x @ w.dequantize().t(), atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.gemm.emulated import without_autocast
from minifloat.kernels import gemv
from minifloat.quant.tensor import QuantizedTensor


@dataclass(frozen=True)
class WeightOnlyKernel:
    name: str
    supports: Callable[[torch.Tensor, QuantizedTensor], bool]
    fn: Callable[[torch.Tensor, QuantizedTensor], torch.Tensor]


_KERNELS: dict[str, WeightOnlyKernel] = {}
_VERSION = [0]  # bumped by every (un)registration: a weight prepacked before one is stale


def register_weight_only_kernel(name: str, supports, fn) -> None:
    """Add (or replace) the weight-only kernel `name`, tried first by ``"auto"`` (see the module docstring)."""
    if name in ("auto", "emulated"):
        raise MinifloatError(f"{name!r} names the dispatch itself; give the kernel another name")
    _KERNELS.pop(name, None)
    _KERNELS[name] = WeightOnlyKernel(name, supports, fn)
    _VERSION[0] += 1


def unregister_weight_only_kernel(name: str) -> None:
    """Remove the weight-only kernel `name` (a user's, or the built-in ``"decode"``)."""
    if name not in _KERNELS:
        raise MinifloatError(f"no weight-only kernel {name!r} is registered; registered: {weight_only_kernels()}")
    del _KERNELS[name]
    _VERSION[0] += 1


def registry_version() -> int:
    """A number that changes with every (un)registration (what a prepacked weight was made under)."""
    return _VERSION[0]


def weight_only_kernels() -> list[str]:
    """The names of the registered kernels, in the order ``"auto"`` tries them."""
    return list(reversed(_KERNELS))


def _reference(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    with without_autocast(x.device):
        return F.linear(x.float(), w.dequantize(torch.float32))


def weight_only_mm(x: torch.Tensor, w: QuantizedTensor, *, backend: str = "auto") -> torch.Tensor:
    """``x · Wᵀ`` in float32 for `x` (M, K) and the packed `w` (N, K); see the module docstring."""
    if not isinstance(w, QuantizedTensor) or w.dim() != 2:
        raise MinifloatError(f"weight_only_mm takes a 2-D QuantizedTensor weight; got {type(w).__name__}")
    if x.shape[-1] != w.shape[1]:
        raise MinifloatError(f"the input has {x.shape[-1]} features, the weight takes {w.shape[1]}")
    if backend in ("auto", "native"):  # "native": a Linear's GEMM backend; weight-only kernels are its native path
        for k in reversed(_KERNELS.values()):
            if k.supports(x, w):
                return k.fn(x, w)
        return _reference(x, w)
    if backend == "emulated":
        return _reference(x, w)
    if backend not in _KERNELS:
        raise MinifloatError(f"unknown weight-only backend {backend!r}; use auto, emulated or one of {weight_only_kernels()}")
    k = _KERNELS[backend]
    if not k.supports(x, w):
        raise MinifloatError(f"the weight-only kernel {backend!r} does not take a {w.scheme.name} weight of "
                             f"{tuple(w.shape)} on {w.device} with a {x.dtype} input; use backend='auto'")  # fmt: skip
    return k.fn(x, w)


register_weight_only_kernel(
    "decode",
    lambda x, w: gemv.supports(x, w.data, w.shape, w.scheme),
    lambda x, w: gemv.run(x, w.data, w.scale, w.tensor_scale, w.shape, w.scheme),
)
