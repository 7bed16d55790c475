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
layouts are tested on any machine (``tests/test_gemm.py`` reads them back by cuBLAS' documented
offset formula); the native calls themselves are checked against ``emulated`` on a capable GPU.

Example:
    >>> from minifloat import quantize
    >>> a, b = torch.randn(8, 64), torch.randn(4, 64)
    >>> qa, qb = quantize(a, "mxfp8"), quantize(b, "mxfp8")
    >>> out = scaled_mm(qa, qb)
    >>> torch.allclose(out, (qa.dequantize().double() @ qb.dequantize().double().T).float(), rtol=1e-6, atol=1e-6)
    True
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.packing import pack, unpack
from minifloat.schemes import Scheme

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
        >>> from minifloat.schemes import get_scheme
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
        >>> from minifloat.schemes import get_scheme
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


def operand_values(q, transposed: bool = False) -> torch.Tensor:
    """The float32 (M,K) matrix a quantized operand stands for; `transposed` when `q` holds
    its transpose (only for tensor-scaled or square-block schemes, whose values do not depend
    on the orientation)."""
    v = q.dequantize(torch.float32)
    v = v.reshape(math.prod(v.shape[:-1]), v.shape[-1])  # not -1: K may be 0 (an empty batch's grad_weight)
    return v.t() if transposed else v


# ---- native: torch._scaled_mm's arguments ---------------------------------------------------
def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`t` (2-D) with zero rows / columns appended up to (rows, cols)."""
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0])) if (rows, cols) != tuple(t.shape) else t


def swizzle_scales(grid: torch.Tensor) -> torch.Tensor:
    """Block scales `grid` (rows, K blocks) in cuBLAS' block-scaling layout, flat: zero-padded to
    128-row × 4-column tiles, tiles in row-major order, and inside a tile the scale of (row r,
    column c) at ``(r % 32) · 16 + (r // 32) · 4 + c``.

    Example:
        >>> g = torch.arange(128 * 4).view(128, 4)
        >>> swizzle_scales(g)[:6].tolist()  # rows 0, 32, 64, 96 side by side, then row 1
        [0, 1, 2, 3, 128, 129]
    """
    rows, cols = grid.shape
    t = _pad(grid, _ceil_to(rows, 128), _ceil_to(cols, 4))
    t = t.view(t.shape[0] // 128, 4, 32, t.shape[1] // 4, 4)  # (row tile, r // 32, r % 32, column tile, c)
    return t.permute(0, 3, 2, 1, 4).reshape(-1)


def _codes(q, transposed: bool) -> torch.Tensor:
    """The stored (packed) code matrix of the operand `q` stands for: q's own, or its transpose."""
    if not transposed:
        return q.data
    fmt = q.scheme.element_format
    rows, width = q.data.shape
    cols = width * 8 // fmt.bits
    if fmt.bits == 8:
        return q.data.t().contiguous()
    codes = unpack(q.data.reshape(-1), fmt, rows * cols).view(rows, cols).t()
    return pack(codes, fmt).view(cols, rows * fmt.bits // 8)


def _scale_grid(q, transposed: bool) -> torch.Tensor:
    """The operand's block scales as one per (row, K block) — square blocks repeated over their
    rows — in their stored dtype (float32, or uint8 E8M0 / E4M3 codes)."""
    grid = q.scale.t() if transposed else q.scale
    br = q.scheme.block[0]
    return grid.repeat_interleave(br, dim=0) if br > 1 and native_kind(q.scheme) == "nvfp4" else grid


def native_args(a, b, *, a_transposed: bool = False, b_transposed: bool = False) -> tuple[dict, tuple[int, int]]:
    """The keyword arguments of ``torch.nn.functional.scaled_mm`` (or of ``torch._scaled_mm``
    for per-tensor and per-row FP8) that compute ``a · bᵀ`` from the stored codes and scales,
    and the (M, N) to crop the result to. Rows are zero-padded to a multiple of 16 and K to
    what the operand types need (zero codes add nothing)."""
    kind = native_kind(a.scheme)
    bits = a.scheme.element_format.bits
    if kind is None or native_kind(b.scheme) != kind or b.scheme.element_format.bits != bits:
        raise MinifloatError(f"no native GEMM of {a.scheme.name} with {b.scheme.name}; use backend='emulated'")
    for q, t in ((a, a_transposed), (b, b_transposed)):
        if t and not (q.scheme.granularity == "tensor" or q.scheme.block and q.scheme.block[0] == q.scheme.block[1]):
            raise MinifloatError(f"the {q.scheme.name} operand cannot be passed transposed: its scales follow its rows")
    if a.scheme.element == b.scheme.element == "e5m2" and a.device.type == "cuda":
        raise MinifloatError("cuBLAS has no E5M2 × E5M2 GEMM; quantize one operand as E4M3 or use backend='emulated'")

    def rows(q, transposed: bool) -> int:  # of the (rows, K) matrix q stands for
        return q.shape[-1] if transposed else q.numel() // q.shape[-1]

    M, N = rows(a, a_transposed), rows(b, b_transposed)
    ca, cb = _codes(a, a_transposed), _codes(b, b_transposed)
    if ca.shape[1] != cb.shape[1]:
        raise MinifloatError(f"operands of different K: {ca.shape[1] * 8 // bits} and {cb.shape[1] * 8 // bits}")
    k_to = _ceil_to(ca.shape[1] * 8 // bits, 32 if bits == 4 else 16)  # rows of whole 16 bytes
    mp, np_ = _ceil_to(max(M, 1), 16), _ceil_to(max(N, 1), 16)
    width = k_to * bits // 8
    ca, cb = _pad(ca[:M], mp, width), _pad(cb[:N], np_, width)
    if bits == 4:
        mat_a, mat_b = ca.view(torch.float4_e2m1fn_x2), cb.view(torch.float4_e2m1fn_x2)
    else:
        mat_a, mat_b = ca.view(_TORCH_FP8[a.scheme.element]), cb.view(_TORCH_FP8[b.scheme.element])
    args = {"mat_a": mat_a, "mat_b": mat_b.t()}

    if kind == "tensor":
        args.update(scale_a=a.scale.reshape(()).float(), scale_b=b.scale.reshape(()).float())
    elif kind == "row":
        args.update(scale_a=_pad(a.scale.reshape(-1, 1).float(), mp, 1), scale_b=_pad(b.scale.reshape(-1, 1).float(), np_, 1).t())
    elif kind == "block128":
        R = F.ScalingType
        for side, q, t, n in (("a", a, a_transposed, mp), ("b", b, b_transposed, np_)):
            grid = q.scale.t() if t else q.scale
            if q.scheme.block == (1, 128):  # (rows, K / 128), outer-dim-major
                s, recipe = _pad(grid, n, k_to // 128).t().contiguous().t(), R.BlockWise1x128
            else:  # (rows / 128, K / 128) padded to 4 columns, passed transposed
                s, recipe = _pad(grid, _ceil_to(n, 128) // 128, _ceil_to(k_to // 128, 4)).t(), R.BlockWise128x128
            args.update({f"scale_{side}": s.float(), f"scale_recipe_{side}": recipe})
    else:
        block = 32 if kind == "mx" else 16
        sdtype = torch.float8_e8m0fnu if kind == "mx" else torch.float8_e4m3fn
        recipe = F.ScalingType.BlockWise1x32 if kind == "mx" else F.ScalingType.BlockWise1x16
        swz = F.SwizzleType.SWIZZLE_32_4_4
        for side, q, t, n in (("a", a, a_transposed, mp), ("b", b, b_transposed, np_)):
            grid = _pad(_scale_grid(q, t)[:n], n, k_to // block)
            s = swizzle_scales(grid).view(sdtype)
            if kind == "mx":
                args.update({f"scale_{side}": s, f"scale_recipe_{side}": recipe, f"swizzle_{side}": swz})
            else:
                ts = q.tensor_scale.reshape(()).float()
                args.update({f"scale_{side}": [s, ts], f"scale_recipe_{side}": [recipe, F.ScalingType.TensorWise],
                             f"swizzle_{side}": [swz, F.SwizzleType.NO_SWIZZLE]})
    return args, (M, N)


def _native(a, b, out_dtype: torch.dtype, a_transposed: bool, b_transposed: bool) -> torch.Tensor:
    if not a.numel() or not b.numel():  # nothing to multiply: zeros of the right shape
        return scaled_mm(a, b, out_dtype=out_dtype, a_transposed=a_transposed, b_transposed=b_transposed)
    args, (M, N) = native_args(a, b, a_transposed=a_transposed, b_transposed=b_transposed)
    if "scale_recipe_a" not in args:  # per tensor / per row: torch._scaled_mm, in every torch
        dtype = out_dtype if a.scheme.granularity == "tensor" else torch.bfloat16
        out = torch._scaled_mm(args.pop("mat_a"), args.pop("mat_b"), **args, out_dtype=dtype)
    else:
        out = F.scaled_mm(**args, output_dtype=torch.bfloat16)
    return out[:M, :N].to(out_dtype)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype torch.autocast runs GEMMs in on `device` here, or None when it is off."""
    try:
        on = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return None
    return torch.get_autocast_dtype(device.type) if on else None


def without_autocast(device: torch.device):
    """torch.autocast off on `device`: its BF16/FP16 would round what the emulated GEMMs
    compute in FP32 (the matmul of the dequantized operands)."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


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
    ``"emulated"``, ``"native"`` or ``"auto"`` (see `choose_backend`)."""
    from minifloat.tensor import QuantizedTensor

    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QuantizedTensor):
            raise MinifloatError(f"scaled_mm takes QuantizedTensors; {name} is a {type(q).__name__} (use minifloat.quantize)")
    if backend != "emulated":  # "native" where it cannot run: a clear error, not torch's
        backend = choose_backend([a.scheme, b.scheme], a.device, backend)
    if backend == "native":
        return _native(a, b, out_dtype, a_transposed, b_transposed)
    if torch.backends.cuda.matmul.allow_tf32 and a.device.type == "cuda":
        raise MinifloatError(
            "torch.backends.cuda.matmul.allow_tf32 is on: TF32 would round the emulated operands; turn it off"
        )
    with without_autocast(a.device):  # FP32 accumulation, as the hardware's, under torch.autocast too
        return (operand_values(a, a_transposed) @ operand_values(b, b_transposed).t()).to(out_dtype)
