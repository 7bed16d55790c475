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
import time
from collections.abc import Callable

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import value_table
from minifloat.formats.registry import E4M3, E8M0, get_format
from minifloat.kernels import cpu, reference
from minifloat.scaling.layout import layout_for
from minifloat.scaling.schemes import Scheme

MAX_ROWS = 16  # rows of x the decode kernels take (a decode step, a speculative verification): MMAX of _gemv.c, checked
ISAS = cpu.ISAS  # the decode kernel's ISA codes 0, 1, 2 are the quantize kernels' variants
_KINDS = {"e2m1": 0, "e3m2": 1, "e2m3": 1, "e4m3": 2, "e5m2": 3}  # element kinds of _gemv.c
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCALE_FORMATS = {"fp32": 0, "e8m0": 1, "e4m3": 2}  # SF_* of _gemv.c
_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class GemvArgs(ctypes.Structure):
    """The arguments of ``mf_gemv``; must match ``gemv_args_t`` in _gemv.c field for field."""

    _fields_ = [
        *((n, _P) for n in ("x", "data", "scales", "slut", "lut", "y")),
        *((n, _L) for n in ("M", "N", "K", "row_bytes", "data_bytes", "br", "bc", "ngc")),
        ("ts", _F), *((n, _I) for n in ("bits", "kind", "nthreads", "isa", "sfmt", "nan_free")),
    ]  # fmt: skip


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = cpu.library()
    if lib is not None:
        lib.mf_gemv_isas.restype = ctypes.c_int
        lib.mf_gemv_isas.argtypes = []
        lib.mf_gemv.restype = ctypes.c_int
        lib.mf_gemv.argtypes = [ctypes.POINTER(GemvArgs)]
        lib.mf_fma_probe.restype = ctypes.c_int
        lib.mf_fma_probe.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        lib.mf_gemv_args_size.restype = lib.mf_gemv_args_last.restype = lib.mf_gemv_max_rows.restype = ctypes.c_int64
        if lib.mf_gemv_max_rows() != MAX_ROWS:
            raise RuntimeError(f"gemv.MAX_ROWS is {MAX_ROWS}, the kernels' MMAX {lib.mf_gemv_max_rows()}: make them agree")
        last = GemvArgs._fields_[-1][0]
        if (lib.mf_gemv_args_size(), lib.mf_gemv_args_last()) != (ctypes.sizeof(GemvArgs), getattr(GemvArgs, last).offset):
            raise RuntimeError(f"GemvArgs does not mirror the kernels' gemv_args_t (size {ctypes.sizeof(GemvArgs)} against "
                               f"{lib.mf_gemv_args_size()}, {last} at {getattr(GemvArgs, last).offset} against {lib.mf_gemv_args_last()})")  # fmt: skip
    return lib


@functools.cache
def _isas() -> tuple[str, ...]:
    lib = _library()
    if lib is None:
        return ()
    mask = lib.mf_gemv_isas()
    return tuple(name for i, name in enumerate(ISAS) if mask >> i & 1)


def isas() -> list[str]:
    """The ISA paths this CPU runs (``"portable"`` always, when the kernels were built)."""
    return list(_isas())


def best_isa() -> str | None:
    """The path calls take: ``MINIFLOAT_GEMV_ISA`` when set, else ``MINIFLOAT_ISA`` (which sets
    the quantize kernels' path too), else the widest this CPU runs."""
    have = _isas()
    variable = "MINIFLOAT_GEMV_ISA" if os.environ.get("MINIFLOAT_GEMV_ISA", "").strip() else "MINIFLOAT_ISA"
    forced = cpu.forced_isa(variable)
    if not forced or not have:
        return have[-1] if have else None
    if forced not in have:
        raise MinifloatError(f"{variable}={forced!r}: this CPU runs {', '.join(have)}; unset it or pick one of them")
    return forced


_LANES = {"portable": 1, "avx2": 8, "avx512": 16}


def multiply_add_rate(threads: int | None = None, isa: str | None = None, seconds: float = 0.05, repeats: int = 3) -> float | None:
    """Float32 multiply-adds per second that the decode kernels' ISA path (`best_isa`, or `isa`)
    can reach here on `threads` threads (torch's count by default): `_gemv.c`'s probe, twelve
    independent multiply-add chains per thread, no memory touched — the best of `repeats` runs of
    about `seconds` each. None without the kernels. No kernel's products go faster: rows of x ×
    multiply-adds a row ÷ this is the least time any number of rows can take."""
    lib, isa = _library(), isa or best_isa()
    if lib is None or isa is None:
        return None
    threads = threads or torch.get_num_threads()
    code, lanes, iters, best = ISAS.index(isa), _LANES[isa], 1 << 16, 0.0
    while True:  # as many rounds as take `seconds` (a first probe of 2^16 rounds sizes it)
        t0 = time.perf_counter()
        used = lib.mf_fma_probe(code, threads, iters)
        took = time.perf_counter() - t0
        best = max(best, 12 * lanes * iters * used / took)
        if took >= seconds:
            repeats -= 1
            if repeats == 0:
                return best
        else:
            iters = int(iters * min(max(seconds / max(took, 1e-6), 2.0), 1000.0))


@functools.cache
def _weight_fits(shape: tuple[int, ...], element: str, granularity: str, block) -> bool:
    """A 2-D weight in an element format the kernels decode, in blocks they walk: 16·j columns
    wide, or one scale per row (per row, per tensor)."""
    if len(shape) != 2 or get_format(element).name not in _KINDS:
        return False
    if granularity != "block":
        return True
    return -(-shape[1] // block[1]) == 1 or block[1] % 16 == 0


def supports(x: torch.Tensor, data: torch.Tensor, shape, scheme: Scheme) -> bool:
    """Whether `matmul` takes this call: CPU tensors, kernels built, at most 16 rows of a float `x`,
    an element format the kernels decode and blocks they walk."""
    return (
        x.device.type == "cpu" and data.device.type == "cpu" and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS and x.dtype in _INPUT_DTYPES
        and _weight_fits(tuple(shape), scheme.element, scheme.granularity, scheme.block) and bool(_isas())
        and os.environ.get("MINIFLOAT_KERNELS") != "reference"  # the debugging switch of minifloat.kernels
    )  # fmt: skip


@functools.cache
def _tables(fmt_name: str, scale_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    lut = value_table(get_format(fmt_name), torch.float32).contiguous()
    slut = None if scale_format == "fp32" else value_table(E8M0 if scale_format == "e8m0" else E4M3, torch.float32)
    return lut, slut


def _plan(data: torch.Tensor, scale: torch.Tensor, tensor_scale, shape, scheme: Scheme) -> GemvArgs:
    """The weight's half of mf_gemv's arguments (addresses, geometry, decode tables, whether any
    code is NaN), checked against the layout. A decode step calls every Linear once per token
    and making these costs more than a small layer's product: `Plan` makes them once."""
    ts = 1.0 if tensor_scale is None else float(tensor_scale)
    lay = layout_for(shape, scheme)
    fmt = scheme.element_format
    row_bytes = lay.cols_pad * fmt.bits // 8
    if tuple(data.shape) != (lay.rows_pad, row_bytes) or not data.is_contiguous():
        raise MinifloatError(f"packed codes of shape {tuple(data.shape)}; a {scheme.name} weight of {tuple(shape)} has {(lay.rows_pad, row_bytes)}, contiguous")
    if tuple(scale.shape) != lay.grid or not scale.is_contiguous() or scale.dtype != (torch.float32 if scheme.scale_format == "fp32" else torch.uint8):
        raise MinifloatError(f"scales of shape {tuple(scale.shape)} {scale.dtype}; a {scheme.name} weight of {tuple(shape)} has {lay.grid}, contiguous")
    lut, slut = _tables(fmt.name, scheme.scale_format)
    plan = GemvArgs(
        data=data.data_ptr(), scales=scale.data_ptr(), slut=None if slut is None else slut.data_ptr(), lut=lut.data_ptr(),
        N=shape[0], K=shape[1], row_bytes=row_bytes, data_bytes=data.numel(), br=lay.block_rows, bc=lay.block_cols,
        ngc=lay.grid[1], ts=ts, bits=fmt.bits, kind=_KINDS[fmt.name], sfmt=_SCALE_FORMATS[scheme.scale_format],
        nan_free=int(not _has_nan_codes(data, fmt)),
    )  # fmt: skip
    return plan


def _has_nan_codes(data: torch.Tensor, fmt) -> bool:
    """Whether any code is NaN: E4M3's S.1111.111 (the kernels decode the others' NaN as they
    are, and FP6 / FP4 have none; the fnuz formats never reach them)."""
    return fmt.name == "e4m3" and bool(((data & 0x7F) == 0x7F).any())


def matmul(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None,
           shape, scheme: Scheme, *, isa: str | None = None) -> torch.Tensor:  # fmt: skip
    """``x · Wᵀ`` in float32, (M, N), for `x` (M, K) and W's parts (as `reference.dequantize`
    takes them: `data` with the layout's padded rows); see the module docstring."""
    if not supports(x, data, shape, scheme):
        raise MinifloatError(f"the decode kernels do not take a {scheme.name} weight of {tuple(shape)} with "
                             f"input {tuple(x.shape)} {x.dtype} on {x.device}; use reference_matmul")  # fmt: skip
    if x.shape[1] != shape[1]:
        raise MinifloatError(f"the input has {x.shape[1]} features, the weight takes {shape[1]}")
    isa = isa or best_isa()
    if isa not in _isas():
        raise MinifloatError(f"ISA path {isa!r} does not run on this CPU; it runs {', '.join(isas())}")
    return run(x, data, scale, tensor_scale, shape, scheme, isa=isa)


def run(x: torch.Tensor, data, scale, tensor_scale, shape, scheme: Scheme, *, isa: str | None = None) -> torch.Tensor:
    """`matmul` for a call `supports` took (the dispatch has asked): no checks repeated, as a
    decode step makes hundreds of these calls per token."""
    return Plan(data, scale, tensor_scale, shape, scheme)(x, isa)


def _bind(plan: GemvArgs, x: torch.Tensor, isa: str | None) -> tuple[GemvArgs, torch.Tensor, torch.Tensor]:
    """The arguments of one call of mf_gemv with the weight's `plan` on `x` (float, M ≤ 16 rows, on
    the CPU): a copy of the plan (calls may run at once) pointing at float32 x and a new output y."""
    args = GemvArgs.from_buffer_copy(plan)
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], plan.N, dtype=torch.float32)
    args.x, args.y, args.M, args.isa = x.data_ptr(), y.data_ptr(), x.shape[0], ISAS.index(isa or best_isa())
    args.nthreads = cpu.threads_for(plan.N * plan.K // 4)  # torch's thread count now
    return args, x, y


def _run(args: GemvArgs) -> None:
    if args.N and _library().mf_gemv(ctypes.byref(args)) != 0:
        raise MemoryError("mf_gemv: no memory for the input's scratch copy")


def _call(plan: GemvArgs, x: torch.Tensor, isa: str | None) -> torch.Tensor:
    """mf_gemv with the weight's `plan` and the input `x` (float, M ≤ 16 rows, on the CPU)."""
    args, x, y = _bind(plan, x, isa)
    _run(args)
    return y


class Plan:
    """`run` for one weight, its arguments made once (`_plan`): the kernel's half of a prepacked
    weight (`minifloat.gemm.prepack`, which says when the weight has changed and a new plan is
    due). It holds the weight's parts, whose addresses the plan points at."""

    __slots__ = ("parts", "meta", "args")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, tensor_scale, shape, scheme: Scheme) -> None:
        self.parts = (data, scale, tensor_scale)
        self.meta = (tuple(shape), scheme)
        self.args = _plan(data, scale, tensor_scale, shape, scheme)

    def __reduce__(self):
        """Copied or pickled as its parts (the plan holds addresses: it is made again)."""
        return Plan, (*self.parts, *self.meta)

    def __call__(self, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        """`run` of a float (M ≤ MAX_ROWS, K) CPU `x` (the caller checks, as `supports` says)."""
        return _call(self.args, x, isa)

    def bound(self, x: torch.Tensor, isa: str | None = None) -> Callable[[], torch.Tensor]:
        """A call of the kernel alone on float32 `x`, its output `y` made once: what a benchmark
        times beside another engine's kernel (the Python of a call, a few µs, and of a cold call,
        up to a hundred, left out; a fused decode step has none)."""
        args, x, y = _bind(self.args, x, isa)

        def call(parts=(x, args, self)) -> torch.Tensor:  # holds what the addresses point at
            _run(args)
            return y

        return call


def reference_matmul(x: torch.Tensor, data, scale, tensor_scale, shape, scheme: Scheme) -> torch.Tensor:
    """The readable path: the weight dequantized (`reference.dequantize`), then an FP32 GEMM."""
    w = reference.dequantize(data, scale, tensor_scale, torch.Size(shape), scheme)
    return x.float() @ w.t()
