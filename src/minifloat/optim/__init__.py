"""Optimizers whose state takes fewer bytes: `AdamW` with moments stored in BF16 or FP8 (per-block
scales, optionally COAT's dynamic range expansion) and BF16 masters (stochastic rounding, or
an int16 remainder that keeps the FP32 master exact); `minifloat.optim.states` the formats."""

from minifloat.optim.adamw import AdamW, bf16_parameters
from minifloat.optim.states import (
    MASTERS,
    STATE_FORMATS,
    bf16_stochastic,
    decode_state,
    dre_forward,
    dre_inverse,
    encode_state,
    join_remainder,
    split_remainder,
    state_bytes,
)

__all__ = ["AdamW", "bf16_parameters", "STATE_FORMATS", "MASTERS", "encode_state", "decode_state", "dre_forward", "dre_inverse",
           "state_bytes", "bf16_stochastic", "split_remainder", "join_remainder"]  # fmt: skip
