"""FP8 GEMMs on a CPU by oneDNN (``torch._scaled_mm`` on CPU tensors), where the setting asks
for them; a probe times them against the emulation and recommends one.

torch runs ``torch._scaled_mm`` on a CPU for FP8 operands with per-tensor or per-row float32
scales and float32 output: the products of two FP8 values are exact in float32, the scales
factor out of each sum, so its result is the emulated one (dequantize, FP32 GEMM) up to
summation order. Whether it is faster depends on the CPU: with AMX it should be far faster;
with AVX-512 or AVX2 alone it runs about as fast as the FP32 GEMM of the emulation or slower.
The choice is a setting, not a timing, so that two runs of one program sum in the same order:
``MINIFLOAT_CPU_SCALED_MM=onednn`` has ``backend="auto"`` GEMMs on a CPU take oneDNN (where
torch runs it and it agrees with the emulation, checked once), ``=emulated`` or unset keeps the
emulation. `probe` times both on one FP8 GEMM (interleaved) and recommends oneDNN where it was
10 % faster or more; `minifloat info` shows the setting and the recommendation. Block scales
along K (MX, NVFP4, 1×128) would need one call per K slice: those keep the emulation.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
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


SETTINGS = ("emulated", "onednn")


def setting() -> str:
    """``MINIFLOAT_CPU_SCALED_MM``: ``"onednn"`` or ``"emulated"`` (the default, when unset)."""
    value = os.environ.get("MINIFLOAT_CPU_SCALED_MM", "").strip() or "emulated"
    if value not in SETTINGS:
        raise MinifloatError(f"MINIFLOAT_CPU_SCALED_MM={value!r}: use onednn or emulated (or unset it: emulated)")
    return value


def _operands() -> tuple:
    m, n, k = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    return quantize(torch.randn(m, k, generator=g), "fp8_rowwise"), quantize(torch.randn(n, k, generator=g), "fp8_rowwise")


def _why_not(a, b) -> str | None:
    """Why oneDNN cannot serve here (torch lacks the kernel, or it disagrees with the emulation by
    more than FP32 summation order), or None."""
    try:
        got = onednn_mm(a, b)
    except (RuntimeError, NotImplementedError, TypeError) as err:  # a torch without the CPU kernel
        return f"torch._scaled_mm does not run here ({str(err).splitlines()[0][:120]})"
    bound = (operand_values(a).abs() @ operand_values(b).abs().t()) * (a.shape[1] * 2.0**-23)
    if not bool(((got - _emulated(a, b)).abs() <= bound).all()):
        return "torch._scaled_mm differs from the emulation by more than FP32 summation order"
    return None


@functools.cache
def uses_onednn() -> bool:
    """Whether ``backend="auto"`` CPU FP8 GEMMs take oneDNN: the setting asks for it, and it runs
    here and agrees with the emulation (checked once per process; a warning where it does not)."""
    if setting() != "onednn":
        return False
    why = _why_not(*_operands())
    if why is not None:
        warnings.warn(f"MINIFLOAT_CPU_SCALED_MM=onednn: {why}; the emulation serves", RuntimeWarning, stacklevel=2)
    return why is None


@functools.cache
def probe() -> Probe:
    """Time oneDNN against the emulation once; `Probe.onednn` is the recommendation (oneDNN runs,
    agrees, and was 10 % faster or more). It decides nothing: `setting` does."""
    a, b = _operands()
    why = _why_not(a, b)
    if why is not None:
        return Probe(False, why)
    times: dict[str, list[float]] = {"onednn": [], "emulated": []}
    for _ in range(3):
        for name, fn in (("onednn", lambda: onednn_mm(a, b)), ("emulated", lambda: _emulated(a, b))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    one, emu = (sorted(times[k])[1] * 1e3 for k in ("onednn", "emulated"))
    faster = one < 0.9 * emu  # by a margin: on a busy machine three rounds can misorder near-equal paths
    m, n, k = PROBE_SHAPE
    return Probe(faster, f"probe {m}x{n}x{k}: oneDNN {one:.2f} ms, emulated {emu:.2f} ms", one, emu)
