"""FP8 GEMMs on a CPU by oneDNN (``torch._scaled_mm`` on CPU tensors), where a one-off probe
finds them faster than the emulation.

torch runs ``torch._scaled_mm`` on a CPU for FP8 operands with per-tensor or per-row float32
scales and float32 output: the products of two FP8 values are exact in float32, the scales
factor out of each sum, so its result is the emulated one (dequantize, FP32 GEMM) up to
summation order. Whether it is faster depends on the CPU: with AMX it should be far faster;
with AVX-512 or AVX2 alone it runs about as fast as the FP32 GEMM of the emulation or slower.
So `probe` times both once per process on one FP8 GEMM (interleaved) and checks that they agree;
``backend="auto"`` GEMMs on a CPU take oneDNN only where the probe found it 10 % faster or more
(`minifloat info` shows the probe). Block scales along K (MX, NVFP4, 1×128) would need one call
per K slice: those keep the emulation. ``MINIFLOAT_CPU_SCALED_MM=onednn`` or ``=emulated``
overrides the probe.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

from minifloat.errors import MinifloatError
from minifloat.gemm.emulated import operand_values
from minifloat.gemm.native import native_args
from minifloat.gemm.support import native_kind
from minifloat.quant import quantize

PROBE_SHAPE = (512, 1024, 1024)  # M, N, K: a training-size GEMM


@dataclass(frozen=True)
class Probe:
    """What `probe` found: whether oneDNN is used, and why."""

    onednn: bool
    why: str
    onednn_ms: float | None = None
    emulated_ms: float | None = None


def takes(a, b) -> bool:
    """Whether oneDNN computes this GEMM: CPU operands, both FP8 with per-tensor or per-row scales."""
    return a.device.type == "cpu" and all(native_kind(q.scheme) in ("tensor", "row") for q in (a, b))


def onednn_mm(a, b, out_dtype: torch.dtype = torch.float32, a_transposed: bool = False, b_transposed: bool = False) -> torch.Tensor:
    """``a · bᵀ`` by ``torch._scaled_mm`` on the CPU, float32 output (exact products, FP32 sums)."""
    args, (m, n) = native_args(a, b, a_transposed=a_transposed, b_transposed=b_transposed)
    out = torch._scaled_mm(args.pop("mat_a"), args.pop("mat_b"), **args, out_dtype=torch.float32)
    return out[:m, :n].to(out_dtype)


def _emulated(a, b) -> torch.Tensor:
    return operand_values(a) @ operand_values(b).t()


@functools.cache
def probe() -> Probe:
    """Time oneDNN against the emulation once (see the module docstring); the result is kept."""
    forced = os.environ.get("MINIFLOAT_CPU_SCALED_MM")
    if forced:
        if forced not in ("onednn", "emulated"):
            raise MinifloatError(f"MINIFLOAT_CPU_SCALED_MM={forced!r}: use onednn or emulated (or unset it to probe)")
        return Probe(forced == "onednn", f"MINIFLOAT_CPU_SCALED_MM={forced}")
    m, n, k = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(m, k, generator=g), "fp8_rowwise")
    b = quantize(torch.randn(n, k, generator=g), "fp8_rowwise")
    try:
        got = onednn_mm(a, b)
    except (RuntimeError, NotImplementedError, TypeError) as err:  # a torch without the CPU kernel
        return Probe(False, f"torch._scaled_mm does not run here ({str(err).splitlines()[0][:120]})")
    want = _emulated(a, b)
    bound = (operand_values(a).abs() @ operand_values(b).abs().t()) * (k * 2.0**-23)
    if not bool(((got - want).abs() <= bound).all()):
        return Probe(False, "torch._scaled_mm differs from the emulation by more than FP32 summation order")
    times: dict[str, list[float]] = {"onednn": [], "emulated": []}
    for _ in range(3):
        for name, fn in (("onednn", lambda: onednn_mm(a, b)), ("emulated", lambda: _emulated(a, b))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    one, emu = (sorted(times[k])[1] * 1e3 for k in ("onednn", "emulated"))
    faster = one < 0.9 * emu  # by a margin: on a busy machine three rounds can misorder near-equal paths
    return Probe(faster, f"probe {m}x{n}x{k}: oneDNN {one:.2f} ms, emulated {emu:.2f} ms", one, emu)
