"""Scaled GEMM on quantized operands: ``a · bᵀ`` with both quantized along K.

Two backends behind one call:

- ``emulated`` (any device): the operands exactly as the hardware sees them — codes × scales,
  dequantized to float32 — multiplied with a float32 GEMM. Products of two elements of
  ≤ 8 significant bits are exact in float32 and the sum accumulates in float32, so the result
  is that of a low-precision GEMM with FP32 accumulation (up to summation order). On CUDA,
  TF32 would round the operands; minifloat never enables it and checks that it is off.
- ``native``: ``torch._scaled_mm`` on the codes and scales as they are stored — cuBLASLt on
  CUDA devices that have the format (chosen automatically there), and PyTorch's CPU
  implementation for per-tensor / per-row FP8 when asked for explicitly (it is slower than
  ``emulated`` on a CPU).

Which schemes run natively where (`native_support`, from PyTorch's and cuBLAS' documented
requirements):

==========================  ===============================  =================================
scheme                      scales as passed                 CUDA compute capability
==========================  ===============================  =================================
FP8 per tensor              FP32 scalar                      ≥ 8.9
FP8 per row                 FP32 ``(M, 1)`` / ``(1, N)``     ≥ 9.0
FP8 1×128 and 128×128       FP32, outer-dim-major            9.0 (PyTorch's restriction)
MXFP8 (E4M3/E5M2), MXFP4    E8M0, 128×4-tile swizzled        ≥ 10.0
NVFP4 (1×16; 16×16 weights) E4M3 swizzled + FP32 tensor      ≥ 10.0
MXFP6, FP6/FP4 per tensor   —                                emulated (no such GEMM in torch)
==========================  ===============================  =================================

A 16×16-block NVFP4 weight is passed as 1×16 blocks (each 16×16 scale repeated over its 16
rows), so the hardware sees the same values. Native block-scaled GEMMs write bfloat16 (what
PyTorch's kernels accept for them) and the result is then cast to `out_dtype`; per-tensor FP8
writes `out_dtype` directly. `native_args` builds the arguments without running them, so the
layouts are tested on any machine (``tests/gemm/test_gemm.py`` reads them back by cuBLAS' documented
offset formula); the native calls themselves are checked against ``emulated`` on a capable GPU.

Example:
    >>> import torch
    >>> from minifloat import quantize
    >>> a, b = torch.randn(8, 64), torch.randn(4, 64)
    >>> qa, qb = quantize(a, "mxfp8"), quantize(b, "mxfp8")
    >>> out = scaled_mm(qa, qb)
    >>> torch.allclose(out, (qa.dequantize().double() @ qb.dequantize().double().T).float(), rtol=1e-6, atol=1e-6)
    True
"""

from minifloat.gemm.api import scaled_mm
from minifloat.gemm.emulated import autocast_dtype, operand_values, without_autocast
from minifloat.gemm.native import native_args, swizzle_scales
from minifloat.gemm.prepacked import DECODE_ROWS, PackedWeight, prepack
from minifloat.gemm.support import (
    BACKENDS,
    choose_backend,
    cpu_flags,
    device_capability,
    native_bf16_cpu,
    native_kind,
    native_support,
)
from minifloat.gemm.weight_only import (
    register_weight_only_kernel,
    unregister_weight_only_kernel,
    weight_only_kernels,
    weight_only_mm,
)

__all__ = [
    "scaled_mm", "weight_only_mm", "register_weight_only_kernel", "unregister_weight_only_kernel", "weight_only_kernels",
    "prepack", "PackedWeight", "DECODE_ROWS", "BACKENDS", "choose_backend", "native_support", "native_kind", "device_capability",
    "cpu_flags", "native_bf16_cpu",
    "native_args", "swizzle_scales", "operand_values", "autocast_dtype", "without_autocast",
]  # fmt: skip
