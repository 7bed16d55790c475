"""What this machine offers minifloat: devices, capabilities, native vs emulated recipes.

Example:
    >>> info = describe()
    >>> info["devices"][0]["device"], sorted(info["devices"][0]["recipes"][0])
    ('cpu', ['backend', 'recipe', 'why'])
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from minifloat.gemm import onednn
from minifloat.gemm.support import choose_backend, cpu_flags, native_support
from minifloat.kernels import cpu, gemv
from minifloat.recipes import RECIPES, ROLES


def _recipes(device: torch.device) -> list[dict]:
    rows = []
    for name, recipe in RECIPES.items():
        schemes = [recipe.scheme(r) for r in ROLES]
        backend = choose_backend(schemes, device)
        why = None if backend == "native" else next((w for s in schemes if (w := native_support(s, device))), None)
        rows.append({"recipe": name, "backend": backend, "why": why})
    return rows


def _fast_kernels() -> str:
    """Whether the quantize kernels were built, how, and which ISA path they take here."""
    have = cpu.isas()
    if not have:
        return "no (reference PyTorch path)"
    build = ("portable build: runs on any CPU of this architecture" if cpu.build() == "portable"
             else "native build (MINIFLOAT_NATIVE=1): this machine's CPU only")  # fmt: skip
    return f"yes, {cpu.isa()} path ({build}; this CPU runs {', '.join(have)}; MINIFLOAT_ISA forces one)"


def _decode_kernels() -> str:
    """Which ISA path the decode kernels (`minifloat.kernels.gemv`) take here."""
    have = gemv.isas()
    if not have:
        return "no (the kernels were not built: weight-only GEMVs dequantize the weight)"
    rate = gemv.multiply_add_rate(seconds=0.02)  # the floor bench decode prints beside rows of x
    return (f"{gemv.best_isa()} (this CPU runs {', '.join(have)}; MINIFLOAT_GEMV_ISA or MINIFLOAT_ISA forces one); "
            f"float32 multiply-adds at most {rate / 1e9:.0f} G/s on {torch.get_num_threads()} threads")


def _fp8_gemm() -> str:
    """The path of CPU FP8 GEMMs (per tensor / per row) and the probe that chose it."""
    path = "oneDNN torch._scaled_mm" if onednn.uses_onednn() else "emulated (dequantize, FP32 GEMM)"
    p = onednn.probe()
    advice = "recommends oneDNN" if p.onednn else "recommends the emulation"
    return f"{path} (MINIFLOAT_CPU_SCALED_MM={onednn.setting()}); the {p.why}: {advice}"


def describe() -> dict:
    """The devices, their capability, and the GEMM backend each recipe gets on each."""
    cpu_dev = torch.device("cpu")
    devices = [{
        "device": "cpu",
        "name": platform.processor() or platform.machine(),
        "detail": f"{os.cpu_count()} cores, {torch.get_num_threads()} threads, ISA: {' '.join(cpu_flags()) or 'unknown'}",
        "capability": None,
        "fast_kernels": _fast_kernels(),
        "decode_kernels": _decode_kernels(),
        "fp8_gemm": _fp8_gemm(),
        "recipes": _recipes(cpu_dev),
    }]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            cap = torch.cuda.get_device_capability(dev)
            devices.append({
                "device": str(dev),
                "name": torch.cuda.get_device_name(dev),
                "detail": f"compute capability {cap[0]}.{cap[1]}",
                "capability": list(cap),
                "fast_kernels": "reference PyTorch path (no CUDA quantize kernels yet)",
                "recipes": _recipes(dev),
            })
    return {"minifloat": importlib.metadata.version("minifloat"), "torch": torch.__version__, "devices": devices}
