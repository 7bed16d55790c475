"""`scaled_mm`: the one entry point of the scaled GEMMs, over both backends."""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.gemm import onednn
from minifloat.gemm.emulated import operand_values, without_autocast
from minifloat.gemm.native import native_mm
from minifloat.gemm.support import choose_backend
from minifloat.quant.tensor import QuantizedTensor


def scaled_mm(
    a,
    b,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "emulated",
    a_transposed: bool = False,
    b_transposed: bool = False,
) -> torch.Tensor:
    """``a · bᵀ`` for quantized `a` (M,K) and `b` (N,K), both quantized along K.

    ``*_transposed``: the operand holds its transpose (see `operand_values`); `backend`:
    ``"emulated"``, ``"native"`` or ``"auto"`` (see `choose_backend`; on a CPU, ``"auto"`` takes
    oneDNN for FP8 per tensor / per row where its probe found it faster: `minifloat.gemm.onednn`)."""
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QuantizedTensor):
            raise MinifloatError(f"scaled_mm takes QuantizedTensors; {name} is a {type(q).__name__} (use minifloat.quantize)")
    if backend == "auto" and onednn.takes(a, b) and a.numel() and b.numel() and onednn.uses_onednn():
        return onednn.onednn_mm(a, b, out_dtype, a_transposed, b_transposed)  # FP8 on a CPU where the setting asks for oneDNN
    if backend != "emulated":  # "native" where it cannot run: a clear error, not torch's
        backend = choose_backend([a.scheme, b.scheme], a.device, backend)
    if backend == "native" and a.numel() and b.numel():  # empty: the emulated zeros of the right shape
        return native_mm(a, b, out_dtype, a_transposed, b_transposed)
    if torch.backends.cuda.matmul.allow_tf32 and a.device.type == "cuda":
        raise MinifloatError(
            "torch.backends.cuda.matmul.allow_tf32 is on: TF32 would round the emulated operands; turn it off"
        )
    with without_autocast(a.device):  # FP32 accumulation, as the hardware's, under torch.autocast too
        return (operand_values(a, a_transposed) @ operand_values(b, b_transposed).t()).to(out_dtype)
