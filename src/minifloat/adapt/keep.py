"""Which layers a GGUF keeps out of FP4 to meet a budget of bits per weight.

llama.cpp's K-quant mixes give some tensors more bits by rule (Q4_K_M: Q6_K for half of the
``attn_v`` / ``ffn_down`` tensors). Here the rule is measured: each candidate layer's cost in FP4
is its Fisher estimate of the KL to the unquantized model (`sensitivity`, one backward pass over
calibration batches), keeping it in the file's rest type (Q8_0 by default) costs
``rest_bits − fp4_bits`` bits, and the multiple-choice knapsack (`knapsack.solve_bounded`) picks
the kept set with the least summed estimate left in FP4 within the budget. Small layers whose FP4
error is large (on SmolLM2: most ``k_proj`` / ``v_proj``) are kept first.

The budget counts the file's tensor data (`gguf_file.dense_bits`: the bits per weight llama.cpp
prints for a model), exactly: FP4 blocks and ``.scale`` tensors at ggml's sizes, the rest type's
blocks, F32 norms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minifloat.adapt.knapsack import solve_bounded
from minifloat.adapt.sensitivity import sensitivity
from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints import gguf_file
from minifloat.infer.ptq.config import QuantConfig, get_quant_config

UNIT = 256  # knapsack costs in units of 256 bits: exact to a few hundred bytes over a real model's file


@dataclass(frozen=True)
class KeepPlan:
    keep: tuple[str, ...]  # layers written in the rest type
    bits: float  # the planned tensor bits per weight
    floor: float  # every candidate layer in FP4
    ceiling: float  # every candidate layer kept
    budget: float
    estimate: dict[str, float]  # each candidate layer's Fisher estimate of its FP4 KL

    def __str__(self) -> str:
        return (f"--budget-bits {self.budget:g}: {len(self.keep)} of {len(self.estimate)} layers kept out of FP4 "
                f"(those whose Fisher-estimated KL costs most per bit), {self.bits:.3f} bits per weight planned "
                f"(all in FP4: {self.floor:.3f}, all kept: {self.ceiling:.3f})")  # fmt: skip


def check_budget(budget_bits) -> None:
    if not (isinstance(budget_bits, (int, float)) and math.isfinite(budget_bits) and budget_bits > 0):
        raise MinifloatError(f"--budget-bits {budget_bits!r}: a positive number of bits per weight")


def keep_within(model: torch.nn.Module, config: str | QuantConfig, data: Sequence[torch.Tensor], budget_bits: float, *,
                dense: tuple[int, int], rest: str = "q8_0", ignore: Sequence[str] = ("lm_head",)) -> KeepPlan:  # fmt: skip
    """The layers of `model` to keep in the `rest` type so that its GGUF in `config` holds at most
    `budget_bits` per weight: `dense` the file's (bits, values) with no layer in FP4
    (`gguf_file.dense_bits`), `data` calibration token batches (B, T + 1) for the estimate."""
    config = get_quant_config(config)
    check_budget(budget_bits)
    s = sensitivity(model, data, [config.name], ignore=ignore, measure="none", estimate_batches=len(data))
    dense_bits, values = dense
    saved = {}  # bits a layer saves in FP4 against the rest type; a layer ggml's blocks cannot hold stays dense
    for name in s.layers:
        n, k = model.get_submodule(name).weight.shape
        if gguf_file.unreadable(config.weight_scheme, n, k) is None:
            saved[name] = gguf_file.rest_bits((n, k), rest) - gguf_file.fp4_bits(config, n, k)
    floor = dense_bits - sum(saved.values())
    if budget_bits * values < floor:
        raise MinifloatError(f"--budget-bits {budget_bits:g}: with every layer it can take in {config.name} the file "
                             f"holds {floor / values:.3f} bits per weight; ask at least that (or drop --budget-bits)")  # fmt: skip
    estimate = {n: s.estimate[n][config.name] for n in saved}
    options = [[(0, estimate[n]), (-(-saved[n] // UNIT), 0.0)] for n in saved]
    picks = solve_bounded(options, int((budget_bits * values - floor) // UNIT)).picks
    keep = tuple(n for n, p in zip(saved, picks, strict=True) if p == 1)
    planned = floor + sum(saved[n] for n in keep)
    return KeepPlan(keep, planned / values, floor / values, dense_bits / values, float(budget_bits), estimate)


def gguf_keep(model_path, config: str | QuantConfig, source, budget_bits: float, *, rest: str = "q8_0",
              ignore: Sequence[str] = ("lm_head",), batches: int = 4) -> KeepPlan:  # fmt: skip
    """`keep_within` for the GGUF at `model_path`, its estimate on the first `batches` calibration
    batches of `source` (a `TextSource`)."""
    from minifloat.data.text import batches_for, tokenizer_for
    from minifloat.infer.checkpoints.loaders import load_model

    check_budget(budget_bits)
    dense = gguf_file.dense_bits(model_path, rest)
    model = load_model(model_path)
    data = batches_for(model, source, "train", tokenizer_for(model_path))[:batches]
    return keep_within(model, config, data, budget_bits, dense=dense, rest=rest, ignore=ignore)
