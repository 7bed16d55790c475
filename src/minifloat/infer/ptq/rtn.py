"""Round to nearest: the weight quantizer every PTQ config uses unless another is given.

A weight quantizer is a function ``(weight (N, K) float, config, stats) -> QuantizedTensor`` in
``config.weight_scheme``: `stats` holds the layer's calibration statistics by observer kind
(`minifloat.infer.ptq.observers`), which round to nearest does not read and GPTQ (the Hessian) or an
MSE scale search will. A transform is a function ``(weight, stats) -> (weight', input_transform)``
whose input transform (an ``nn.Module`` on the input rows, or None) keeps ``x · Wᵀ`` unchanged
in exact arithmetic: a rotation (W·R, x → x·R) or smoothing (W·diag(s), x → x / s).

Example:
    >>> from minifloat.infer.ptq.config import get_quant_config
    >>> q = round_to_nearest(torch.randn(32, 64), get_quant_config("mxfp4-weight-only"), {})
    >>> q.scheme.name, q.shape
    ('mxfp4_rceil', torch.Size([32, 64]))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minifloat.infer.ptq.config import QuantConfig
from minifloat.quant import QuantizedTensor, quantize
from minifloat.scaling import rules

WeightQuantizer = Callable[[torch.Tensor, QuantConfig, dict], QuantizedTensor]
Transform = Callable[[torch.Tensor, dict], tuple[torch.Tensor, "torch.nn.Module | None"]]


def pow2_global_amax(w: torch.Tensor, numerator: float = rules.NVFP4_GLOBAL_NUMERATOR) -> torch.Tensor | None:
    """For an NVFP4 weight: the tensor amax that makes its global encode scale S = 448·6 / amax
    the power of two at or below the one of w's own amax (None for a NaN or inf amax).

    A power-of-two S makes every reader's decode agree bit for bit: compressed-tensors divides
    the E4M3 block scale by S (and rounds its dequantized weights to bf16), minifloat multiplies
    by 1/S; with S = 2^k both are exact. It costs accuracy, measured (`QuantConfig`)."""
    a = w.float().abs().max()
    if not torch.isfinite(a):
        return None
    s = rules.nvfp4_global_scale(a, numerator)
    s = torch.exp2(torch.floor(torch.log2(s)))
    return torch.tensor(numerator, dtype=torch.float32) / s


def tensor_amax(weights: list[torch.Tensor], config: QuantConfig) -> torch.Tensor | None:
    """The NVFP4 tensor amax `weights` share (fused q/k/v, gate/up: one global scale, so that an
    engine can fuse them), power-of-two with ``pow2_global_scale`` (`pow2_global_amax`); None
    where the quantizer measures its own: other schemes, one weight with the exact scale."""
    ws = config.weight_scheme
    if not ws.is_nvfp4 or (len(weights) == 1 and not config.pow2_global_scale):
        return None
    if config.pow2_global_scale:
        numerator = rules.NVFP4_4OVER6_NUMERATOR if ws.scale_rule == "4over6" else rules.NVFP4_GLOBAL_NUMERATOR
        return pow2_global_amax(torch.stack([w.float().abs().max() for w in weights]), numerator)
    return torch.stack([rules.finite_amax(w.float(), ignore_nan=True) for w in weights]).amax()


def round_to_nearest(weight: torch.Tensor, config: QuantConfig, stats: dict) -> QuantizedTensor:
    """Each weight rounded to the nearest value of its block's scaled grid (the scheme's own
    scale rule; for NVFP4 with ``pow2_global_scale`` the power-of-two global scale)."""
    return quantize(weight, config.weight_scheme, amax=tensor_amax([weight], config))
