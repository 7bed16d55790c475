"""Sub-byte packing: FP4 two codes per byte, FP6 four codes in three bytes.

Codes are packed in row-major (flattened) order into a 1-D ``torch.uint8`` tensor; a tail that
does not fill the last byte group is padded with zero codes, and `unpack` takes the element
count back so any length round-trips.

Bit layouts (first element in the least significant bits, as torch's ``float4_e2m1fn_x2``
and torchao lay out FP4):

- FP4 (e2m1): ``byte[i] = code[2i] | code[2i+1] << 4``.
- FP6 (e3m2, e2m3): four codes form the 24-bit little-endian word
  ``w = c0 | c1 << 6 | c2 << 12 | c3 << 18``, stored as ``w & 0xFF, (w >> 8) & 0xFF,
  w >> 16``. In bytes: ``b0 = c0 | (c1 & 3) << 6``, ``b1 = c1 >> 2 | (c2 & 15) << 4``,
  ``b2 = c2 >> 4 | c3 << 2``.
- 8-bit formats are stored one code per byte (packing is a flattening copy).

Example:
    >>> codes = torch.tensor([1, 2, 3], dtype=torch.uint8)
    >>> pack(codes, "e2m1").tolist()
    [33, 3]
    >>> unpack(pack(codes, "e2m1"), "e2m1", 3).tolist()
    [1, 2, 3]
"""

from __future__ import annotations

import torch

from minifloat.errors import DTypeError, PackingError
from minifloat.formats.codec import check_codes
from minifloat.formats.registry import FloatFormat, get_format

# codes per group and bytes per group, by element width
_GROUPS: dict[int, tuple[int, int]] = {4: (2, 1), 6: (4, 3), 8: (1, 1)}


def _group(fmt: FloatFormat) -> tuple[int, int]:
    try:
        return _GROUPS[fmt.bits]
    except KeyError:
        raise PackingError(f"no packing for {fmt.bits}-bit format {fmt.name}") from None


def codes_per_group(fmt: FloatFormat) -> int:
    """How many codes of `fmt` fill a whole number of bytes (FP4 2, FP6 4, FP8 1): a packed
    row's length is a multiple of it."""
    return _group(fmt)[0]


def packed_nbytes(numel: int, fmt: str | FloatFormat) -> int:
    """Bytes that `numel` codes of `fmt` take once packed.

    Example:
        >>> packed_nbytes(5, "e2m1"), packed_nbytes(5, "e3m2"), packed_nbytes(5, "e4m3")
        (3, 6, 5)
    """
    codes_per, bytes_per = _group(get_format(fmt))
    return -(-numel // codes_per) * bytes_per


def pack(codes: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """Pack `codes` (uint8, any shape) of `fmt` into a 1-D uint8 tensor; see module doc."""
    fmt = get_format(fmt)
    check_codes(codes, fmt, what="pack")
    codes_per, _ = _group(fmt)
    flat = codes.reshape(-1).to(torch.uint8)
    if codes_per == 1:
        return flat.clone()
    pad = -flat.numel() % codes_per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    g = flat.view(-1, codes_per)
    if fmt.bits == 4:
        return g[:, 0] | (g[:, 1] << 4)
    c0, c1, c2, c3 = g.unbind(1)
    b0 = c0 | ((c1 & 0x3) << 6)
    b1 = (c1 >> 2) | ((c2 & 0xF) << 4)
    b2 = (c2 >> 4) | (c3 << 2)
    return torch.stack([b0, b1, b2], dim=1).reshape(-1)


def unpack(data: torch.Tensor, fmt: str | FloatFormat, numel: int) -> torch.Tensor:
    """Inverse of `pack`: the first `numel` codes of `fmt` in `data`, as 1-D uint8."""
    fmt = get_format(fmt)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise DTypeError(f"unpack takes the torch.uint8 tensor that pack returned, got {got}")
    if not isinstance(numel, int) or numel < 0:
        raise PackingError(f"numel must be a non-negative int, got {numel!r}")
    expected = packed_nbytes(numel, fmt)
    if data.numel() != expected:
        raise PackingError(
            f"{numel} {fmt.name} codes pack into {expected} bytes, but data has {data.numel()}; "
            f"pass the element count that was packed"
        )
    codes_per, bytes_per = _group(fmt)
    flat = data.reshape(-1)
    if codes_per == 1:
        return flat.clone()
    g = flat.view(-1, bytes_per)
    if fmt.bits == 4:
        codes = torch.stack([g[:, 0] & 0xF, g[:, 0] >> 4], dim=1)
    else:
        b0, b1, b2 = g.unbind(1)
        codes = torch.stack(
            [b0 & 0x3F, (b0 >> 6) | ((b1 & 0xF) << 2), (b1 >> 4) | ((b2 & 0x3) << 4), b2 >> 2],
            dim=1,
        )
    return codes.reshape(-1)[:numel].clone()
