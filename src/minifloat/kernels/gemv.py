"""Decode kernels: ``x · Wᵀ`` in float32 for a few rows of `x` and a packed weight's parts, read
in place (``mf_gemv`` in _gemv.c): no dequantized weight is written. Beside them,
`reference_matmul` — the weight dequantized by `minifloat.kernels.reference`, then an FP32
GEMM — which every ISA path equals up to FP32 summation order.

The paths (`isas`): ``"avx512"``, ``"avx2"`` and ``"portable"``, each in every build and chosen
at run time by what the CPU has (`best_isa`); ``MINIFLOAT_GEMV_ISA=avx2`` (or a call's `isa=`)
forces one, as the tests do in turn.

Example:
    >>> from minifloat.kernels import quantize
    >>> from minifloat.scaling.schemes import get_scheme
    >>> s = get_scheme("nvfp4")
    >>> w = torch.randn(8, 64)
    >>> parts = quantize(w, s)
    >>> x = torch.randn(2, 64)
    >>> y = matmul(x, *parts, w.shape, s)
    >>> torch.allclose(y, reference_matmul(x, *parts, w.shape, s), atol=1e-4)
    True
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import value_table
from minifloat.formats.registry import E4M3, E8M0
from minifloat.kernels import cpu, reference
from minifloat.scaling.layout import layout_for
from minifloat.scaling.schemes import Scheme

MAX_ROWS = 16  # rows of x the decode kernels take (a decode step, a speculative verification)
ISAS = ("portable", "avx2", "avx512")  # the kernel's ISA codes 0, 1, 2
_KINDS = {"e2m1": 0, "e3m2": 1, "e2m3": 1, "e4m3": 2, "e5m2": 3}  # element kinds of _gemv.c
_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class GemvArgs(ctypes.Structure):
    """The arguments of ``mf_gemv``; must match ``gemv_args_t`` in _gemv.c field for field."""

    _fields_ = [
        *((n, _P) for n in ("x", "data", "scales", "slut", "lut", "y")),
        *((n, _L) for n in ("M", "N", "K", "row_bytes", "data_bytes", "br", "bc", "ngc")),
        ("ts", _F), *((n, _I) for n in ("bits", "kind", "nthreads", "isa")),
    ]  # fmt: skip


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = cpu.library()
    if lib is not None:
        lib.mf_gemv_isas.restype = ctypes.c_int
        lib.mf_gemv_isas.argtypes = []
        lib.mf_gemv.restype = ctypes.c_int
        lib.mf_gemv.argtypes = [ctypes.POINTER(GemvArgs)]
    return lib


def isas() -> list[str]:
    """The ISA paths this CPU runs (``"portable"`` always, when the kernels were built)."""
    lib = _library()
    if lib is None:
        return []
    mask = lib.mf_gemv_isas()
    return [name for i, name in enumerate(ISAS) if mask >> i & 1]


def best_isa() -> str | None:
    """The path calls take: ``MINIFLOAT_GEMV_ISA`` when set, else the widest this CPU runs."""
    have = isas()
    if not have:
        return None
    forced = os.environ.get("MINIFLOAT_GEMV_ISA")
    if forced:
        if forced not in have:
            raise MinifloatError(f"MINIFLOAT_GEMV_ISA={forced!r}: this CPU runs {', '.join(have)}; unset it or pick one of them")
        return forced
    return have[-1]


def _blocks_fit(lay) -> bool:
    """The kernels take blocks 16·j columns wide, or one scale per row (per row, per tensor)."""
    return lay.grid[1] == 1 or lay.block_cols % 16 == 0


def supports(x: torch.Tensor, data: torch.Tensor, shape, scheme: Scheme) -> bool:
    """Whether `matmul` takes this call: CPU tensors, kernels built, at most 16 rows of a float `x`,
    an element format the kernels decode and blocks they walk."""
    return (
        os.environ.get("MINIFLOAT_KERNELS", "auto") != "reference"  # the debugging switch of minifloat.kernels
        and x.device.type == "cpu" and data.device.type == "cpu" and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and len(shape) == 2 and scheme.element_format.name in _KINDS and _blocks_fit(layout_for(shape, scheme))
        and _library() is not None
    )  # fmt: skip


@functools.cache
def _tables(fmt_name: str, scale_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    from minifloat.formats.registry import get_format

    lut = value_table(get_format(fmt_name), torch.float32).contiguous()
    slut = None if scale_format == "fp32" else value_table(E8M0 if scale_format == "e8m0" else E4M3, torch.float32)
    return lut, slut


def matmul(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None,
           shape, scheme: Scheme, *, isa: str | None = None) -> torch.Tensor:  # fmt: skip
    """``x · Wᵀ`` in float32, (M, N), for `x` (M, K) and W's parts (as `reference.dequantize`
    takes them: `data` with the layout's padded rows); see the module docstring."""
    if not supports(x, data, shape, scheme):
        raise MinifloatError(f"the decode kernels do not take a {scheme.name} weight of {tuple(shape)} with "
                             f"input {tuple(x.shape)} {x.dtype} on {x.device}; use reference_matmul")  # fmt: skip
    isa = isa or best_isa()
    if isa not in isas():
        raise MinifloatError(f"ISA path {isa!r} does not run on this CPU; it runs {', '.join(isas())}")
    lay = layout_for(shape, scheme)
    fmt = scheme.element_format
    n, k = shape
    if x.shape[1] != k:
        raise MinifloatError(f"the input has {x.shape[1]} features, the weight takes {k}")
    lut, slut = _tables(fmt.name, scheme.scale_format)
    x = x.float().contiguous()
    data = data.contiguous()
    row_bytes = lay.cols_pad * fmt.bits // 8
    if data.shape != (lay.rows_pad, row_bytes):
        raise MinifloatError(f"packed codes of shape {tuple(data.shape)}; a {scheme.name} weight of {tuple(shape)} has {(lay.rows_pad, row_bytes)}")
    scales = scale.contiguous() if slut is None else scale.contiguous().view(torch.uint8)
    if slut is None:
        scales = scales.float()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    args = GemvArgs(
        x=x.data_ptr(), data=data.data_ptr(), scales=scales.data_ptr(), slut=None if slut is None else slut.data_ptr(),
        lut=lut.data_ptr(), y=y.data_ptr(), M=x.shape[0], N=n, K=k, row_bytes=row_bytes, data_bytes=data.numel(),
        br=lay.block_rows, bc=lay.block_cols, ngc=lay.grid[1], ts=1.0 if tensor_scale is None else float(tensor_scale),
        bits=fmt.bits, kind=_KINDS[fmt.name], nthreads=cpu.threads_for(n * k // 4), isa=ISAS.index(isa),
    )  # fmt: skip
    if n and _library().mf_gemv(ctypes.byref(args)) != 0:
        raise MemoryError("mf_gemv: no memory for the input's scratch copy")
    return y


def reference_matmul(x: torch.Tensor, data, scale, tensor_scale, shape, scheme: Scheme) -> torch.Tensor:
    """The readable path: the weight dequantized (`reference.dequantize`), then an FP32 GEMM."""
    w = reference.dequantize(data, scale, tensor_scale, torch.Size(shape), scheme)
    return x.float() @ w.t()
