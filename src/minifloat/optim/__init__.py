"""Optimizers whose state takes fewer bytes: `AdamW` with moments stored in BF16 or FP8 (per-block
scales, optionally COAT's dynamic range expansion), `minifloat.optim.states` the storage formats."""

from minifloat.optim.adamw import AdamW
from minifloat.optim.states import (
    STATE_FORMATS,
    decode_state,
    dre_forward,
    dre_inverse,
    encode_state,
    state_bytes,
)

__all__ = ["AdamW", "STATE_FORMATS", "encode_state", "decode_state", "dre_forward", "dre_inverse", "state_bytes"]
