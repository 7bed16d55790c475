"""The tensors of a serving checkpoint, as both formats write and read them: a weight's packed codes
cropped to its shape (the block padding is not stored), and a lazy reader that checks each
tensor's name, dtype and shape before it is used, so a malformed checkpoint is an error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.quant import QuantizedTensor

FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # what a scale stored as a float may be


def codes(q: QuantizedTensor) -> torch.Tensor:
    """The packed codes cropped to the tensor's shape (rows, packed columns)."""
    n, k = q.shape
    return q.data[:n, : k * q.scheme.element_format.bits // 8].contiguous()


class CheckpointTensors:
    """The checkpoint's tensors by name, read lazily from its safetensors files."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise MinifloatError(f"{folder} has no model.safetensors nor model.safetensors.index.json")
        self.where: dict[str, object] = {}
        self._handles = []
        for f in files:
            if not (folder / f).is_file():
                raise MinifloatError(f"{folder / f}: listed in the index but missing")
            h = safe_open(str(folder / f), framework="pt", device="cpu")
            self._handles.append(h)
            for k in h.keys():
                self.where[k] = h
        self.used: set[str] = set()

    def dtype(self, name: str) -> torch.dtype:
        return self.where[name].get_tensor(name).dtype

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(
        self, name: str, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        if name not in self.where:
            raise MinifloatError(f"checkpoint tensor {name!r} is missing")
        t = self.where[name].get_tensor(name)
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes:
            raise MinifloatError(
                f"checkpoint tensor {name!r} is {t.dtype}; expected {' or '.join(map(str, dtypes))}"
            )
        if tuple(t.shape) != tuple(shape):
            raise MinifloatError(
                f"checkpoint tensor {name!r} has shape {tuple(t.shape)}; expected {tuple(shape)}"
            )
        self.used.add(name)
        return t
