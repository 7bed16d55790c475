"""Element formats: the registry (the only place bit layouts are written), the readable
codec, and sub-byte packing."""

from minifloat.formats.codec import decode, encode, value_table
from minifloat.formats.packing import pack, packed_nbytes, unpack
from minifloat.formats.registry import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E4M3FNUZ,
    E5M2,
    E5M2FNUZ,
    E8M0,
    FORMATS,
    FloatFormat,
    NaNEncoding,
    fnuz_scale_factor,
    get_format,
)

__all__ = [
    "FloatFormat", "NaNEncoding", "FORMATS", "get_format", "E4M3", "E5M2", "E3M2", "E2M3", "E2M1", "E8M0", "E4M3FNUZ", "E5M2FNUZ", "fnuz_scale_factor",
    "encode", "decode", "value_table", "pack", "unpack", "packed_nbytes",
]  # fmt: skip
