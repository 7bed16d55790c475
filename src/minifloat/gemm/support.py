"""Which GEMMs run natively where — the CPU's BF16 units, the GPU's scaled GEMMs — and the
backend each call gets.

The table of native GEMMs (from PyTorch's and cuBLAS' documented requirements) is in the
`minifloat.gemm` package docstring; `native_support` says why a scheme does not run natively
on a device, `choose_backend` picks ``"native"`` or ``"emulated"``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.scaling.schemes import Scheme

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


BACKENDS = ("auto", "emulated", "native")
_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# The native GEMM family of each scheme kind and the compute capability it needs: (lowest, highest).
_NEEDS = {"tensor": ((8, 9), None), "row": ((9, 0), None), "block128": ((9, 0), (9, 0)),
          "mx": ((10, 0), None), "nvfp4": ((10, 0), None)}
_NAMES = {"tensor": "FP8 per-tensor", "row": "FP8 row-wise", "block128": "FP8 128-block",
          "mx": "MX block-scaled", "nvfp4": "NVFP4"}


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """CUDA compute capability of `device`, None for other devices."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def native_kind(scheme: Scheme) -> str | None:
    """Which native GEMM family `scheme` belongs to (a key of the table above), None if none.

    Example:
        >>> from minifloat.scaling.schemes import get_scheme
        >>> [native_kind(get_scheme(n)) for n in ("fp8", "fp8_block128x128", "mxfp4", "nvfp4_2d", "mxfp6_e3m2")]
        ['tensor', 'block128', 'mx', 'nvfp4', None]
    """
    if scheme.scale_format == "fp32":
        if scheme.element not in _TORCH_FP8:
            return None
        if scheme.granularity != "block":
            return scheme.granularity
        return "block128" if scheme.block in ((1, 128), (128, 128)) else None
    if scheme.is_mx:
        return "mx" if scheme.block == (1, 32) and scheme.element in ("e4m3", "e5m2", "e2m1") else None
    return "nvfp4" if scheme.block in ((1, 16), (16, 16)) else None


def native_support(scheme: Scheme, device: torch.device | str) -> str | None:
    """Why `scheme` cannot run natively on `device` (None when it can, automatically).

    Example:
        >>> from minifloat.scaling.schemes import get_scheme
        >>> native_support(get_scheme("fp8"), "cpu")
        'no native low-precision GEMM on cpu (torch._scaled_mm runs there only when asked for)'
        >>> native_support(get_scheme("mxfp6_e3m2"), "cpu")
        'mxfp6_e3m2: torch._scaled_mm has no GEMM for e3m2 elements with e8m0 block (1, 32) scales'
    """
    device = torch.device(device)
    kind = native_kind(scheme)
    if kind is None:
        what = f"{scheme.scale_format} {scheme.granularity}" + (f" {scheme.block}" if scheme.block else "")
        return f"{scheme.name}: torch._scaled_mm has no GEMM for {scheme.element} elements with {what} scales"
    if kind not in ("tensor", "row") and not hasattr(F, "scaled_mm"):
        return f"{_NAMES[kind]} GEMMs need torch.nn.functional.scaled_mm (torch ≥ 2.10), this is torch {torch.__version__}"
    cap = device_capability(device)
    if cap is None:
        return f"no native low-precision GEMM on {device.type} (torch._scaled_mm runs there only when asked for)"
    low, high = _NEEDS[kind]
    if cap < low or (high is not None and cap > high):
        need = f"≥ {low[0]}.{low[1]}" if high is None else f"exactly {low[0]}.{low[1]}"
        return f"{_NAMES[kind]} GEMMs need compute capability {need}, this GPU is {cap[0]}.{cap[1]}"
    return None


def _can_force_native(scheme: Scheme, device: torch.device) -> bool:
    if device.type == "cpu":  # PyTorch's CPU _scaled_mm: per-tensor and per-row FP8
        return native_kind(scheme) in ("tensor", "row")
    return native_support(scheme, device) is None


def choose_backend(schemes: list[Scheme], device: torch.device | str, requested: str = "auto") -> str:
    """``"native"`` or ``"emulated"`` for GEMMs on `schemes` on `device`."""
    device = torch.device(device)
    if requested not in BACKENDS:
        raise MinifloatError(f"unknown GEMM backend {requested!r}; use one of {', '.join(BACKENDS)}")
    if requested == "emulated":
        return "emulated"
    if requested == "native":
        bad = list(dict.fromkeys(s.name for s in schemes if not _can_force_native(s, device)))
        if bad:
            raise MinifloatError(
                f"backend='native' cannot run {', '.join(bad)} on {device}; use backend='auto' or 'emulated'"
            )
        return "native"
    return "native" if all(native_support(s, device) is None for s in schemes) else "emulated"
