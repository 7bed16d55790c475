"""Block geometry: the padded 2-D view every scheme quantizes, and the parts it produces.

Every scheme works on the 2-D view ``(rows, K)`` of the input (rows = all leading dims),
zero-padded so that the last dim fills whole blocks (and whole bytes once packed) and, for 2-D
blocks, so that the rows fill whole blocks too. Padding never changes an amax and is cropped
on dequantize. The scale grid is always 2-D: ``(rows_pad // block_rows, cols_pad // block_cols)``
— ``(1, 1)`` for a tensor scale, ``(rows, 1)`` for row scales.

Example:
    >>> from minifloat.scaling.schemes import get_scheme
    >>> layout_for((3, 40), get_scheme("nvfp4")).grid
    (3, 3)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.packing import codes_per_group
from minifloat.scaling.rules import canonical_nan
from minifloat.scaling.schemes import Scheme


def ceil_to(n: int, m: int) -> int:
    """The smallest multiple of `m` that is ≥ `n`."""
    return -(-n // m) * m


@dataclass(frozen=True)
class Layout:
    """Geometry of a quantized tensor's 2-D view."""

    rows: int
    cols: int
    rows_pad: int
    cols_pad: int
    block_rows: int
    block_cols: int

    @property
    def grid(self) -> tuple[int, int]:
        """Shape of the scale grid."""
        return self.rows_pad // self.block_rows, self.cols_pad // self.block_cols

    @property
    def tiles(self) -> tuple[int, int, int, int]:
        """Shape that views the padded 2-D tensor as (grid rows, block rows, grid cols, block cols)."""
        return self.grid[0], self.block_rows, self.grid[1], self.block_cols


def layout_for(shape: torch.Size | tuple[int, ...], scheme: Scheme) -> Layout:
    """The padded 2-D geometry of a tensor of `shape` under `scheme`."""
    cols = shape[-1] if len(shape) else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    if scheme.granularity == "block":
        br, bc = scheme.block
        return Layout(rows, cols, ceil_to(rows, br), ceil_to(cols, bc), br, bc)
    cols_pad = ceil_to(cols, codes_per_group(scheme.element_format))
    br = 1 if scheme.granularity == "row" else max(rows, 1)
    return Layout(rows, cols, rows, cols_pad, br, max(cols_pad, 1))


def part_specs(shape: torch.Size | tuple[int, ...], scheme: Scheme) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of every part a quantized tensor of `shape` under `scheme` holds:
    ``data`` (packed codes), ``scale`` (the scale grid) and, for NVFP4, ``tensor_scale``.

    Example:
        >>> from minifloat.scaling.schemes import get_scheme
        >>> part_specs((3, 40), get_scheme("nvfp4"))["scale"]
        (torch.uint8, (3, 3))
    """
    lay = layout_for(shape, scheme)
    specs = {
        "data": (torch.uint8, (lay.rows_pad, lay.cols_pad * scheme.element_format.bits // 8)),
        "scale": (torch.float32 if scheme.scale_format == "fp32" else torch.uint8, lay.grid),
    }
    if scheme.is_nvfp4:
        specs["tensor_scale"] = (torch.float32, ())
    return specs


def as_float32(value: torch.Tensor | float, what: str) -> torch.Tensor:
    """A user-given scale or amax as a float32 tensor (NaNs canonical), or a clear error."""
    try:
        return canonical_nan(torch.as_tensor(value, dtype=torch.float32))
    except (TypeError, ValueError, RuntimeError):
        raise MinifloatError(f"{what} must be a number or a float tensor, got {type(value).__name__} {value!r}") from None


def to_grid(value: torch.Tensor | float, layout: Layout, what: str) -> torch.Tensor:
    """A user-given scale or amax (a scalar, one per row, or one per block) broadcast to the
    scale grid: a contiguous float32 tensor of shape ``layout.grid``."""
    t = as_float32(value, what)
    try:
        return torch.broadcast_to(t.reshape(t.shape if t.dim() != 1 else (-1, 1)), layout.grid).contiguous()
    except RuntimeError:
        raise MinifloatError(
            f"{what} of shape {tuple(t.shape)} does not fit the scale grid {layout.grid}; "
            f"pass a scalar, or one value per block"
        ) from None
