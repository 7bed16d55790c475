"""ctypes bindings of the fused CPU kernels in ``_cpu.c`` and the quantize / dequantize paths
built on them: the same arguments and results as `minifloat.kernels.reference`'s.

The library holds the kernels once per ISA path (``ISAS``; `_cpu.c`'s runtime dispatch):
`library()` binds the widest this CPU runs, or the one ``MINIFLOAT_ISA`` names (which sets the
decode kernels' path too, `minifloat.kernels.gemv`); `variant(isa)` binds any other one this
CPU runs, for the tests that hold each to the reference."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import math
import os
import warnings
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import sr_seed, value_table
from minifloat.formats.registry import E4M3, E8M0, FloatFormat, NaNEncoding
from minifloat.scaling import rules
from minifloat.scaling.layout import layout_for

SOURCES = ("_cpu.c", "_cpu_avx2.c", "_cpu_avx512.c", "_gemv.c", "_decode.c", "_gemv.h")  # as setup.py hashes them, in this order
ISAS = ("portable", "avx2", "avx512")  # the variants of _cpu.c; bit i of mf_cpu_isas() is ISAS[i]
KERNELS = ("mf_amax", "mf_quantize", "mf_block_amax", "mf_encode_sr", "mf_transpose", "mf_rht16", "mf_dequantize")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MODES = {"fp32": 0, "fp32_given": 1, "e8m0": 2, "e4m3": 3}
_RULES = {"floor": 0, "rceil": 1, "4over6": 1, "least-error": 2}  # the kernel's rule: 1 rounds E8M0 up, or Four Over Six (NVFP4 mode); 2 MX's "least-error"
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_I32 = ctypes.c_int32


class ElemParams(ctypes.Structure):
    """Must match ``elem_t`` in _cpu.c."""

    _fields_ = [(n, ctypes.c_int32) for n in ("man_bits", "emin", "emax", "max_code", "sign_mask", "nan_code")] + [
        (n, ctypes.c_uint32) for n in ("rebias", "min_normal_bits", "max_bits", "magic_bits")
    ]


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF


class QuantizeArgs(ctypes.Structure):
    """The arguments of ``mf_quantize``; must match ``quantize_args_t`` in _cpu.c field for field."""

    _fields_ = [
        ("x", _P), ("elem", ctypes.POINTER(ElemParams)), ("e4m3", ctypes.POINTER(ElemParams)),
        ("given", _P), ("e4m3_lut", _P), ("tile_amax", _P), ("out", _P), ("scale_out", _P),
        *((n, _L) for n in ("R", "K", "Rp", "Kp", "br", "bc", "gs_r", "gs_c")), ("seed", ctypes.c_uint64),
        *((n, _I32) for n in ("dt", "bits", "mode", "rule", "sr", "no_nan", "nthreads")),
        *((n, _F) for n in ("fmt_max", "margin_mul", "inv_max", "s_enc", "s_dec")),
    ]  # fmt: skip


@functools.cache
def elem_params(fmt: FloatFormat) -> ElemParams:
    """Constants of the bit-trick encoder, all derived from the format's definition.
    NaN encodes canonically (as a positive NaN), as `encode_with_bits(canonical_nan=True)`."""
    m = fmt.man_bits
    nan_code = fmt.nan_code if fmt.nan_code is not None else fmt.sign_mask  # ml_dtypes: FP6/FP4 +NaN -> -0
    return ElemParams(
        m, fmt.emin, fmt.emax, fmt.max_code, fmt.sign_mask, nan_code,
        ((fmt.bias - 127) << 23) & 0xFFFFFFFF, _f32_bits(fmt.min_normal), _f32_bits(fmt.max),
        _f32_bits(2.0 ** (fmt.emin - m + 23)),
    )


class Kernels:
    """The quantize kernels of one ISA variant (``mf_amax`` … bound to ``mf_amax_<isa>`` …);
    every other name (the decode kernels, the build facts) is the library's own."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.lib, self.isa = lib, isa
        for name in KERNELS:
            setattr(self, name, getattr(lib, f"{name}_{isa}"))
        _declare(self)

    def __getattr__(self, name: str):
        return getattr(self.lib, name)


def _load() -> ctypes.CDLL | None:
    """The compiled library, or None (with one warning) when the build did not produce it."""
    spec = importlib.util.find_spec("minifloat.kernels._cpu")
    try:
        if spec is None or spec.origin is None:
            raise OSError("the extension minifloat.kernels._cpu was not built")
        lib = ctypes.CDLL(spec.origin)
        _check_built_from_this_source(lib)
        for isa in ISAS:
            for name in KERNELS:
                getattr(lib, f"{name}_{isa}")  # a library without a kernel this code calls: AttributeError
        lib.mf_cpu_isas.restype = ctypes.c_int
        lib.mf_build.restype = ctypes.c_char_p
    except (OSError, AttributeError) as err:
        warnings.warn(
            f"minifloat: fast CPU kernels unavailable ({err}); using the pure-PyTorch reference. "
            f"Reinstall with a C compiler (gcc with OpenMP) to build them (`make test` or "
            f"`pip install -e .` in a checkout).",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return lib


def forced_isa(variable: str = "MINIFLOAT_ISA") -> str | None:
    """The ISA path the environment `variable` names, checked against `ISAS`, or None."""
    forced = os.environ.get(variable, "").strip().lower() or None
    if forced is not None and forced not in ISAS:
        raise MinifloatError(f"{variable}={forced!r}: not an ISA path; use one of {', '.join(ISAS)}, or unset it")
    return forced


@functools.lru_cache(maxsize=1)
def library() -> Kernels | None:
    """The compiled kernels of the widest ISA path this CPU runs, or of the one ``MINIFLOAT_ISA``
    names; None (with one warning) when the build did not produce them."""
    lib = _load()
    if lib is None:
        return None
    have = [name for i, name in enumerate(ISAS) if lib.mf_cpu_isas() >> i & 1]
    forced = forced_isa()
    if forced is not None and forced not in have:
        raise MinifloatError(f"MINIFLOAT_ISA={forced!r}: this CPU runs {', '.join(have)}; unset it or pick one of them")
    return Kernels(lib, forced or have[-1])


def isas() -> tuple[str, ...]:
    """The ISA paths of the quantize kernels this CPU runs (``()`` without the kernels)."""
    k = library()
    return () if k is None else tuple(name for i, name in enumerate(ISAS) if k.lib.mf_cpu_isas() >> i & 1)


def isa() -> str | None:
    """The path `library()` takes: ``MINIFLOAT_ISA`` when set, else the widest this CPU runs."""
    k = library()
    return None if k is None else k.isa


def build() -> str | None:
    """How the library was compiled: ``"portable"`` (runs on any CPU of its architecture, ISA
    paths chosen at run time) or ``"native"`` (``MINIFLOAT_NATIVE=1``: this machine's CPU only)."""
    k = library()
    return None if k is None else k.lib.mf_build().decode()


def variant(name: str) -> Kernels:
    """The kernels of ISA path `name`, which this CPU must run."""
    if name not in isas():
        raise MinifloatError(f"ISA path {name!r}: this CPU runs {', '.join(isas()) or 'none (no kernels built)'}")
    return Kernels(library().lib, name)


def _check_built_from_this_source(lib: ctypes.CDLL) -> None:
    """Refuse a library built from another version of _cpu.c (an updated checkout not rebuilt):
    its kernels may differ from the reference this code expects. Installs without the source
    file skip the check."""
    sources = [Path(__file__).with_name(name) for name in SOURCES]
    if not all(s.exists() for s in sources):
        return
    lib.mf_source_hash.restype = ctypes.c_char_p
    built = lib.mf_source_hash().decode()
    here = hashlib.sha256(b"".join(s.read_bytes() for s in sources)).hexdigest()[:16]
    if built != here:
        raise OSError(f"{lib._name} was built from other versions of {', '.join(SOURCES)} ({built}, these are {here})")


def _declare(lib: Kernels) -> None:
    lib.mf_amax.restype = _F
    lib.mf_amax.argtypes = [_P, _I, _L, _I, _I]
    lib.mf_quantize.restype = None
    lib.mf_quantize.argtypes = [ctypes.POINTER(QuantizeArgs)]
    lib.mf_block_amax.restype = _F
    lib.mf_block_amax.argtypes = [_P, _I, _L, _L, _L, _L, _L, _L, _P, _I]
    lib.mf_encode_sr.restype = None
    lib.mf_encode_sr.argtypes = [_P, _P, _L, _P, _P]
    lib.mf_transpose.restype = None
    lib.mf_transpose.argtypes = [_P, _P, _L, _L, _I, _I]
    lib.mf_rht16.restype = None
    lib.mf_rht16.argtypes = [_P, _P, _L, _P, _I]
    lib.mf_dequantize.restype = None
    lib.mf_dequantize.argtypes = [_P, _L, _L, _L, _I, _P, _P, _P, _P, _F, _L, _L, _P, _I]


def encode_sr(y: torch.Tensor, bits: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The kernels' stochastic rounding of float32 `y` with the uint32 random `bits` (int64
    tensor), element by element: for tests, which pick bits at the rounding thresholds."""
    y = y.contiguous().reshape(-1)
    b = bits.reshape(-1).to(torch.int64)
    rb = torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).contiguous()  # uint32 bits as int32
    out = torch.empty(y.numel(), dtype=torch.uint8)
    library().mf_encode_sr(y.data_ptr(), rb.data_ptr(), y.numel(), ctypes.byref(elem_params(fmt)), out.data_ptr())
    return out


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can serve tensors on `device` (CPU, and the build succeeded)."""
    return device.type == "cpu" and library() is not None


def supports(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and runs_on(x.device)


def encodes(fmt: FloatFormat) -> bool:
    """Whether the bit-trick encoder and decoder serve `fmt`: every format but the fnuz ones, whose
    −0 is their NaN (the kernels put a sign on a rounded zero); those take the reference."""
    return fmt.nan is not NaNEncoding.NEG_ZERO


SERIAL_BELOW = 1 << 15  # elements: below it one thread is faster than waking the others


def threads_for(n: int) -> int:
    """Threads for a kernel over `n` elements: torch's count, or one for a small tensor (a decode
    step's KV rows): waking the OpenMP team costs more than it saves there, and on a busy machine
    its barrier waits for a core (measured on 2 busy cores: a 3 × 64 NVFP4 quantize 0.088 ms with
    two threads, 0.035 ms with one; 1.5 ms a call in a decode step's profile under heavier load)."""
    return 1 if n < SERIAL_BELOW else torch.get_num_threads()


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``; the transpose of a contiguous matrix (``m.t()``, the column-wise
    operands of training) is copied by the tiled transpose kernel (`mf_transpose` in _cpu.c)."""
    if x.dim() == 2 and not x.is_contiguous() and x.stride() == (1, x.shape[0]):
        out = torch.empty(x.shape, dtype=x.dtype)
        library().mf_transpose(x.data_ptr(), out.data_ptr(), x.shape[1], x.shape[0], x.element_size(),
                               threads_for(x.numel()))  # fmt: skip
        return out
    return x.contiguous()


def rht16(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """`reference.rht` of contiguous float32 `x` (last dim a multiple of 16)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    s = signs.to(torch.float32).contiguous()
    library().mf_rht16(x.data_ptr(), out.data_ptr(), x.numel() // 16, s.data_ptr(), threads_for(x.numel()))
    return out


def amax_value(x: torch.Tensor, *, ignore_nan: bool = False) -> float:
    """`minifloat.scaling.rules.finite_amax` of a whole (contiguous) tensor in one parallel pass, as a float."""
    return library().mf_amax(x.data_ptr(), _DTYPES[x.dtype], x.numel(), int(ignore_nan), threads_for(x.numel()))


def tensor_amax(x: torch.Tensor, *, ignore_nan: bool = False) -> torch.Tensor:
    """`minifloat.scaling.rules.finite_amax` of a whole tensor in one parallel pass."""
    return torch.tensor(amax_value(x.contiguous(), ignore_nan=ignore_nan), dtype=torch.float32)


@functools.cache
def _scheme_args(scheme) -> tuple:
    """mf_quantize's per-scheme arguments, from the element format's parameters to the
    E4M3 table (held here, so its pointer stays valid): built once per scheme."""
    fmt = scheme.element_format
    lut = value_table(E4M3, torch.float32)
    return (
        (ctypes.pointer(elem_params(fmt)), fmt.bits, _MODES[scheme.scale_format], _RULES[scheme.scale_rule],
         fmt.max, math.ldexp(1.0, -scheme.margin), rules.as_float32(1.0 / fmt.max)),
        (ctypes.pointer(elem_params(E4M3)), lut.data_ptr()),
        lut,
    )


def quantize(x, scheme, *, scale=None, amax=None, rounding="nearest", generator=None):
    """`minifloat.kernels.reference.quantize` in one fused pass (two for NVFP4 and for a
    per-tensor scale of a tensor's own amax); returns ``(data, scale, tensor_scale)``.
    `x` is non-empty (the reference handles empty layouts)."""
    lib = library()
    fmt = scheme.element_format
    lay = layout_for(x.shape, scheme)
    x = contiguous(x)
    dt, threads = _DTYPES[x.dtype], threads_for(x.numel())
    rows_pad, cols_pad = lay.rows_pad, lay.cols_pad
    data = torch.empty(rows_pad, cols_pad * fmt.bits // 8, dtype=torch.uint8)
    br, bc = lay.block_rows, lay.block_cols
    (elem, bits, mode, rule, fmt_max, margin_mul, inv_max), (e4m3, lut_ptr), _ = _scheme_args(scheme)
    given = None  # the encode scale(s), when known before the pass
    gs_r = gs_c = 0
    s_enc = s_dec = 1.0
    no_nan = 0  # 1: x is known to hold no NaN, so the kernel need not look for NaN lanes
    tensor_scale = None
    if scheme.scale_format == "fp32" and (scale is not None or amax is not None or scheme.granularity == "tensor"):
        if scale is not None:
            given = scale
        elif amax is not None:
            given = rules.fp32_scale(amax, fmt, scheme.margin)
        else:  # just in time: the tensor amax (NaN when x holds one), then its scale
            a = amax_value(x)
            no_nan = int(not math.isnan(a))
            given = torch.tensor([[rules.fp32_scale_scalar(a, fmt, scheme.margin)]], dtype=torch.float32)
        gs_r, gs_c = given.stride()
        mode = _MODES["fp32_given"]
        if scheme.granularity == "tensor":  # one scale: tile by rows so the threads share the work
            br, gs_r, gs_c = 1, 0, 0
    tile_amax = None
    if scheme.is_nvfp4:
        if amax is None:  # first pass: block maxima (kept for the second) and the tensor amax
            tile_amax = torch.empty(rows_pad // br, cols_pad // bc, dtype=torch.float32)
            g = lib.mf_block_amax(x.data_ptr(), dt, lay.rows, lay.cols, rows_pad, cols_pad, br, bc,
                                  tile_amax.data_ptr(), threads)  # fmt: skip
        else:
            g = float(amax)
        four_over_six = scheme.scale_rule == "4over6"  # rule 1 in the kernel's NVFP4 mode
        s_enc = rules.nvfp4_global_scale_scalar(g, rules.NVFP4_4OVER6_NUMERATOR if four_over_six else rules.NVFP4_GLOBAL_NUMERATOR)
        s_dec = rules.as_float32(1.0 / s_enc)
        tensor_scale = torch.tensor(s_dec, dtype=torch.float32)
    grid = (rows_pad // br, cols_pad // bc)
    scale_out = torch.empty(grid, dtype=torch.float32 if scheme.scale_format == "fp32" else torch.uint8)
    seed = sr_seed(generator) if rounding == "stochastic" else None
    args = QuantizeArgs(
        x=x.data_ptr(), elem=elem, e4m3=e4m3, given=None if given is None else given.data_ptr(), e4m3_lut=lut_ptr,
        tile_amax=None if tile_amax is None else tile_amax.data_ptr(), out=data.data_ptr(),
        scale_out=scale_out.data_ptr(), R=lay.rows, K=lay.cols, Rp=rows_pad, Kp=cols_pad, br=br, bc=bc, gs_r=gs_r,
        gs_c=gs_c, seed=seed or 0, dt=dt, bits=bits, mode=mode, rule=rule, sr=int(seed is not None), no_nan=no_nan,
        nthreads=threads, fmt_max=fmt_max, margin_mul=margin_mul, inv_max=inv_max, s_enc=s_enc, s_dec=s_dec,
    )  # fmt: skip
    lib.mf_quantize(ctypes.byref(args))
    if scheme.granularity == "tensor":  # one scale per row: they agree, but where a row held a NaN
        nan = fmt.nan_code is None and bool(scale_out.isnan().any())  # that FP6 / FP4 cannot encode
        scale_out = torch.full((1, 1), math.nan) if nan else scale_out[:1, :1].clone()
    return data, scale_out, tensor_scale


def dequantize(data, scale, tensor_scale, shape, scheme, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`minifloat.kernels.reference.dequantize` in one fused pass."""
    lay = layout_for(shape, scheme)
    out = torch.empty(shape, dtype=torch.float32)
    if out.numel():
        fmt = scheme.element_format
        if scheme.scale_format == "fp32":  # decode scales as they are
            scales, slut, ts = scale.float().contiguous(), None, 1.0
        else:  # 8-bit scale codes, decoded in the kernel: E8M0, or E4M3 times the tensor scale
            scales = scale.contiguous().view(torch.uint8)
            slut = value_table(E8M0 if scheme.scale_format == "e8m0" else E4M3, torch.float32)
            ts = 1.0 if tensor_scale is None else float(tensor_scale)
        library().mf_dequantize(
            data.contiguous().data_ptr(), lay.cols_pad, lay.block_rows, lay.block_cols, fmt.bits,
            ctypes.byref(elem_params(fmt)), value_table(fmt, torch.float32).data_ptr(), scales.data_ptr(),
            None if slut is None else slut.data_ptr(), ts, lay.rows, lay.cols, out.data_ptr(), threads_for(out.numel()),
        )  # fmt: skip
    return out if dtype == torch.float32 else out.to(dtype)
