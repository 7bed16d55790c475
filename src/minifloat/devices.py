"""What this machine offers minifloat: devices, capabilities, native vs emulated recipes.

Example:
    >>> info = describe()
    >>> info["devices"][0]["device"], sorted(info["devices"][0]["recipes"][0])
    ('cpu', ['backend', 'recipe', 'why'])
"""

from __future__ import annotations

import functools
import os
import platform

import torch

from minifloat.gemm import choose_backend, native_support
from minifloat.recipes import RECIPES, ROLES

CPUINFO = "/proc/cpuinfo"
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_fp16")  # the ones we report


def cpu_flags() -> list[str]:
    """Which of `ISA_FLAGS` this CPU has (Linux ``/proc/cpuinfo``; elsewhere none known)."""
    return list(_flags_in(CPUINFO))


@functools.cache  # read once: the trainer asks for every micro-batch of a bf16 run
def _flags_in(cpuinfo: str) -> tuple[str, ...]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(f for f in ISA_FLAGS if f in have)
    except OSError:
        pass
    return ()


def native_bf16_cpu() -> bool:
    """Whether this CPU has BF16 matrix units (else BF16 GEMMs are emulated in FP32)."""
    return any(f in cpu_flags() for f in ("avx512_bf16", "amx_bf16"))


def _recipes(device: torch.device) -> list[dict]:
    rows = []
    for name, recipe in RECIPES.items():
        schemes = [recipe.scheme(r) for r in ROLES]
        backend = choose_backend(schemes, device)
        why = None if backend == "native" else next((w for s in schemes if (w := native_support(s, device))), None)
        rows.append({"recipe": name, "backend": backend, "why": why})
    return rows


def describe() -> dict:
    """The devices, their capability, and the GEMM backend each recipe gets on each."""
    from minifloat import __version__
    from minifloat.kernels import cpu

    cpu_dev = torch.device("cpu")
    devices = [{
        "device": "cpu",
        "name": platform.processor() or platform.machine(),
        "detail": f"{os.cpu_count()} cores, {torch.get_num_threads()} threads, ISA: {' '.join(cpu_flags()) or 'unknown'}",
        "capability": None,
        "fast_kernels": "yes (compiled C/OpenMP)" if cpu.runs_on(cpu_dev) else "no (reference PyTorch path)",
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
    return {"minifloat": __version__, "torch": torch.__version__, "devices": devices}
