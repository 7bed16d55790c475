"""The native backend: ``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm`` on the codes and
scales as they are stored. `native_args` builds the arguments without running them, so the
layouts are tested on any machine (``tests/gemm/test_gemm.py`` reads them back by cuBLAS' documented
offset formula); the native calls themselves are checked against the emulated backend on a
capable GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minifloat.errors import MinifloatError
from minifloat.formats.packing import pack, unpack
from minifloat.gemm.support import _TORCH_FP8, native_kind
from minifloat.scaling.layout import ceil_to


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
    t = _pad(grid, ceil_to(rows, 128), ceil_to(cols, 4))
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
    k_to = ceil_to(ca.shape[1] * 8 // bits, 32 if bits == 4 else 16)  # rows of whole 16 bytes
    mp, np_ = ceil_to(max(M, 1), 16), ceil_to(max(N, 1), 16)
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
            else:  # (rows / 128, K / 128) padded to 4 columns, passed transposed (a transposed grid unpadded is a view: made contiguous)
                s, recipe = _pad(grid, ceil_to(n, 128) // 128, ceil_to(k_to // 128, 4)).contiguous().t(), R.BlockWise128x128
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


def native_mm(a, b, out_dtype: torch.dtype, a_transposed: bool, b_transposed: bool) -> torch.Tensor:
    """``a · bᵀ`` by the native GEMM, for non-empty operands (`native_args`)."""
    args, (M, N) = native_args(a, b, a_transposed=a_transposed, b_transposed=b_transposed)
    if "scale_recipe_a" not in args:  # per tensor / per row: torch._scaled_mm, in every torch
        dtype = out_dtype if a.scheme.granularity == "tensor" else torch.bfloat16
        out = torch._scaled_mm(args.pop("mat_a"), args.pop("mat_b"), **args, out_dtype=dtype)
    else:
        out = F.scaled_mm(**args, output_dtype=torch.bfloat16)
    return out[:M, :N].to(out_dtype)
