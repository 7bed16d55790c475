"""Scale observers: a weight's block scales on the real scale grid, chosen before any element is
rounded — what round to nearest and GPTQ quantize on (`minifloat.quant.quantize_with_scales`).

- ``minmax``: the scheme's own rule (each block's amax maps to the element format's largest
  value; MX: the E8M0 exponent rule, NVFP4: the E4M3 block scale under the FP32 tensor scale).
- ``mse``: per block, the scale on the scheme's own scale grid whose round-to-nearest
  quantization of the block has the least squared error: every E8M0 exponent from 6 below the
  minmax one to 2 above it; every E4M3 code (NVFP4 block scales under the minmax tensor scale)
  from 24 below the minmax code (three octaves) to 8 above it; for FP32 scales, the amax shrunk
  by 0 … 20 % in steps of 1 % (llm-compressor's MSE grid) — a continuous grid has no brute
  force. Ties keep the minmax scale, then the larger one. Unlike llm-compressor's MSE observer,
  which searches a float shrink and then rounds the NVFP4 scale to E4M3, the search here is on
  the values the checkpoint can hold.
- ``4over6``: NVFP4's Four Over Six (per block the E4M3 scale that maps the amax to 6 or to 4,
  whichever errs less): the scheme's ``4over6`` scale rule (`minifloat.infer.ptq.config`).

Example:
    >>> from minifloat.scaling.schemes import get_scheme
    >>> w = torch.randn(8, 64)
    >>> s = observe_scales(w, get_scheme("mxfp4"), "mse")
    >>> tuple(s.scale.shape)
    (8, 2)
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.formats.codec import decode, encode_with_bits, pow2
from minifloat.formats.registry import E8M0
from minifloat.kernels.reference import padded_tiles
from minifloat.quant import BlockScales, block_scales
from minifloat.scaling import rules
from minifloat.scaling.schemes import Scheme

SCALE_OBSERVERS = ("minmax", "mse", "4over6")
MSE_E8M0_STEPS = (-6, 2)  # exponents searched, relative to the minmax one
MSE_E4M3_STEPS = (-24, 8)  # E4M3 codes searched, relative to the minmax one
MSE_SHRINK = tuple(1 - i / 100 for i in range(21))  # FP32 scales: amax × 1.00, 0.99, …, 0.80


def check_observer(name: str, scheme: Scheme) -> str:
    if name not in SCALE_OBSERVERS:
        raise MinifloatError(f"unknown scale observer {name!r}; use one of {', '.join(SCALE_OBSERVERS)}")
    if name == "4over6" and not scheme.is_nvfp4:
        raise MinifloatError(f"the 4over6 observer chooses NVFP4 block scales; {scheme.name} is not NVFP4 (use minmax or mse)")
    return name


def observe_scales(weight: torch.Tensor, scheme: Scheme, observer: str = "minmax", *,
                   amax: torch.Tensor | None = None) -> BlockScales:  # fmt: skip
    """The block scales of `weight` (N, K) under `scheme` chosen by `observer` (module docstring).
    `amax`: NVFP4's tensor amax (the minmax one when None). ``4over6`` expects `scheme` to carry
    that scale rule already (the config's ``scale_rule="4over6"``)."""
    check_observer(observer, scheme)
    base = block_scales(weight, scheme, amax=amax)
    if observer != "mse":
        return base
    return _mse(weight.float(), scheme, base)


def block_errors(tiles: torch.Tensor, scheme: Scheme, encode: torch.Tensor, decode_scale: torch.Tensor) -> torch.Tensor:
    """Per block (the grid), the float64 sum of squared errors of rounding `tiles` to nearest on
    the element grid with these per-block multipliers."""
    fmt = scheme.element_format
    codes = encode_with_bits(tiles * encode[:, None, :, None], fmt, saturate=True, canonical_nan=True)
    err = decode(codes, fmt).double() * decode_scale[:, None, :, None].double() - tiles.double()
    return err.square().sum(dim=(1, 3))


def _mse(w: torch.Tensor, scheme: Scheme, base: BlockScales) -> BlockScales:
    _, tiles = padded_tiles(w, scheme)
    candidates = []  # (encode, stored) per candidate, the minmax one first (ties keep it)
    if scheme.scale_format == "e8m0":
        exp = base.scale.long() - E8M0.bias
        lo, hi = MSE_E8M0_STEPS
        for d in (0, *range(hi, 0, -1), *range(-1, lo - 1, -1)):
            e = (exp + d).clamp(-127, 127)
            candidates.append((pow2(-e).float(), (e + E8M0.bias).to(torch.uint8)))
    elif scheme.scale_format == "e4m3":
        lo, hi = MSE_E4M3_STEPS
        code = base.scale.long()
        for d in (0, *range(hi, 0, -1), *range(-1, lo - 1, -1)):
            c = (code + d).clamp(1, 126).to(torch.uint8)  # positive finite E4M3 codes
            candidates.append((rules.nvfp4_encode_scales(c, base.tensor_scale), c))
    else:
        amax = rules.finite_amax(tiles, dim=(1, 3))
        for p in MSE_SHRINK:
            enc = rules.fp32_scale(amax * p, scheme.element_format, scheme.margin)
            candidates.append((enc, 1.0 / enc))
    best_enc, best_stored = base.encode.clone(), base.scale.clone()
    best = block_errors(tiles, scheme, base.encode, base.decode(scheme))
    keep = ~torch.isfinite(best) | (base.encode == 0)  # NaN blocks, all-zero NVFP4 blocks: as minmax made them
    for enc, stored in candidates[1:]:
        dec = rules.decode_scales(stored, base.tensor_scale, scheme.scale_format)
        err = block_errors(tiles, scheme, enc, dec)
        better = (err < best) & ~keep
        best = torch.where(better, err, best)
        best_enc = torch.where(better, enc, best_enc)
        best_stored = torch.where(better, stored, best_stored)
    return BlockScales(best_enc, best_stored, base.tensor_scale)

