"""How an optimizer moment is stored: the format names and their encode / decode.

A moment (a float32 tensor of a parameter's shape) is flattened and cut into blocks of `block`
values (the last one zero-padded):

- ``"fp32"``: as it is; ``"bf16"``: rounded to bfloat16 (nearest even);
- ``"fp8"``: E4M3 codes with one float32 scale per block (the block's absmax onto E4M3's max;
  minifloat's own row-scaled quantizer, ``fp8_rowwise`` over the (blocks, block) view);
- ``"fp8-dre"``: COAT's dynamic range expansion (Xi et al., 2024) before the same E4M3 step. Per
  block, with c = √(min·max) of the nonzero magnitudes and k = log R / log(max / min), R the
  ratio of E4M3's largest to smallest normal value: y = sign(x) · (|x| / c)^k, so the block's
  magnitudes span E4M3's whole normal range instead of crowding its top; decoding takes
  x = sign(y) · |y|^(1/k) · c. A block of one magnitude (or all zeros) keeps k = 1.

`encode_state` returns a dict of plain tensors (what the optimizer's state_dict holds and
checkpoints save); `decode_state` turns it back into float32.
"""

from __future__ import annotations

import math

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import sr_bits
from minifloat.formats.registry import E4M3
from minifloat.quant import QuantizedTensor, quantize
from minifloat.scaling.schemes import get_scheme

STATE_FORMATS = ("fp32", "bf16", "fp8", "fp8-dre")
MASTERS = ("fp32", "bf16-sr", "bf16+remainder")
_BLOCKS = get_scheme("fp8_rowwise")  # one float32 scale per row of the (blocks, block) view
_RANGE = math.log(E4M3.max / E4M3.min_normal)  # log R: E4M3's normal range


def state_bytes(numel: int, fmt: str, block: int = 128) -> float:
    """Bytes one moment of `numel` values takes in `fmt` (E4M3 codes padded to whole blocks, a
    float32 scale per block, and for ``fp8-dre`` the block's centre and exponent)."""
    if fmt not in STATE_FORMATS:
        raise MinifloatError(f"unknown optimizer state format {fmt!r}; use one of {', '.join(STATE_FORMATS)}")
    if fmt in ("fp32", "bf16"):
        return (4 if fmt == "fp32" else 2) * numel
    blocks = -(-numel // block)
    return blocks * (block + 4 + (8 if fmt == "fp8-dre" else 0))


def bf16_stochastic(x: torch.Tensor, seed: int) -> torch.Tensor:
    """float32 `x` rounded to bfloat16 stochastically: up with probability (the dropped 16 bits) /
    2^16 — 16 counter-based random bits (`minifloat.formats.codec.sr_bits` of `seed`) added to the
    magnitude's low half, then truncated — so the expected value is `x`. inf and NaN pass as they are."""
    bits = x.detach().float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = sr_bits(seed, x.numel(), x.device).view(x.shape) & 0xFFFF
    special = (bits & 0x7F800000) == 0x7F800000
    rounded = torch.where(special, bits, (bits + r) & 0xFFFF0000)
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32)
    return rounded.view(torch.float32).to(torch.bfloat16)


def split_remainder(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `w` as its nearest bfloat16 and the int16 remainder of its bits: bits(w) =
    bits(bf16 as float32) + remainder exactly (`join_remainder`)."""
    high = w.float().to(torch.bfloat16)
    rem = w.float().view(torch.int32).to(torch.int64) - high.float().view(torch.int32).to(torch.int64)
    return high, rem.to(torch.int16)


def join_remainder(high: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The float32 `split_remainder` split, exactly."""
    return (high.float().view(torch.int32).to(torch.int64) + rem.to(torch.int64)).to(torch.int32).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.detach().reshape(-1).float()
    pad = -flat.numel() % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def dre_forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """COAT's expansion of each row of `x` (blocks): ``(y, c, k)``, c and k one per row (any float dtype)."""
    mag = x.abs()
    nonzero = mag > 0
    big = torch.where(nonzero, mag, torch.zeros_like(mag)).amax(dim=1, keepdim=True)
    small = torch.where(nonzero, mag, torch.full_like(mag, math.inf)).amin(dim=1, keepdim=True)
    empty = ~nonzero.any(dim=1, keepdim=True)
    small = torch.where(empty, torch.ones_like(small), small)
    big = torch.where(empty, torch.ones_like(big), big)
    c = torch.sqrt(small * big)
    spread = torch.log(big / small)
    k = torch.where(spread > 0, _RANGE / spread.clamp_min(1e-30), torch.ones_like(spread))
    y = torch.sign(x) * torch.where(nonzero, (mag / c) ** k, torch.zeros_like(mag))
    return y, c, k


def dre_inverse(y: torch.Tensor, c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The inverse of `dre_forward`: sign(y) · |y|^(1/k) · c per row."""
    mag = y.abs()
    return torch.sign(y) * torch.where(mag > 0, mag ** (1 / k) * c, torch.zeros_like(mag))


def encode_state(x: torch.Tensor, fmt: str, block: int = 128) -> dict[str, torch.Tensor]:
    """The stored form of the float32 moment `x` in `fmt` (see the module docstring)."""
    if fmt == "fp32":
        return {"value": x.detach().float().clone()}
    if fmt == "bf16":
        return {"value": x.detach().to(torch.bfloat16)}
    if fmt not in STATE_FORMATS:
        raise MinifloatError(f"unknown optimizer state format {fmt!r}; use one of {', '.join(STATE_FORMATS)}")
    b = _blocks(x, block)
    out = {}
    if fmt == "fp8-dre":
        b, c, k = dre_forward(b)
        out.update(dre_c=c.reshape(-1), dre_k=k.reshape(-1))
    q = quantize(b, _BLOCKS)
    out.update(codes=q.data, scale=q.scale.reshape(-1))
    return out


def decode_state(stored: dict[str, torch.Tensor], fmt: str, shape: torch.Size) -> torch.Tensor:
    """The float32 moment of `shape` that `stored` (from `encode_state`) holds."""
    if fmt in ("fp32", "bf16"):
        return stored["value"].float()
    codes, scale = stored["codes"], stored["scale"]
    q = QuantizedTensor(codes, scale.view(-1, 1), None, codes.shape, _BLOCKS)
    b = q.dequantize(torch.float32)
    if fmt == "fp8-dre":
        b = dre_inverse(b, stored["dre_c"].view(-1, 1), stored["dre_k"].view(-1, 1))
    n = math.prod(shape)
    return b.reshape(-1)[:n].view(shape)
