"""`save` / `load`: QuantizedTensors (and plain tensors) in a safetensors file.

No pickle. Each QuantizedTensor ``name`` is stored as the tensors ``name.data``,
``name.scale`` (and ``name.tensor_scale``), with its scheme, shape and dtype in the header's
metadata. The metadata also holds a SHA-256 of every tensor's bytes, so a file whose bytes were
changed after saving is rejected, not silently loaded. Writes are atomic (temp file + rename):
an interrupted save leaves the previous file intact.

Example:
    >>> import tempfile, os, minifloat
    >>> q = minifloat.quantize(torch.randn(3, 40), "nvfp4")
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> minifloat.save(path, {"w": q, "b": torch.zeros(3)})
    >>> back = minifloat.load(path)
    >>> torch.equal(back["w"].dequantize(), q.dequantize()), back["b"].shape
    (True, torch.Size([3]))
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

import torch

from minifloat.atomic import atomic_path
from minifloat.errors import MinifloatError
from minifloat.schemes import Scheme
from minifloat.tensor import QuantizedTensor

FORMAT_TAG = "minifloat/1"
_PARTS = ("data", "scale", "tensor_scale")


class CorruptFileError(MinifloatError):
    """A file that is not a complete, unmodified minifloat safetensors file."""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save(path: str | os.PathLike[str], tensors: Mapping[str, QuantizedTensor | torch.Tensor]) -> None:
    """Write `tensors` (name → QuantizedTensor or tensor) to `path` atomically."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise MinifloatError(f"tensor names must be non-empty strings, got {name!r}")
        if isinstance(value, QuantizedTensor):
            parts = {p: getattr(value, p) for p in _PARTS if getattr(value, p) is not None}
            entries[name] = {
                "kind": "quantized",
                "scheme": value.scheme.to_dict(),
                "shape": list(value.shape),
                "dtype": _dtype_name(value.orig_dtype),
            }
        elif isinstance(value, torch.Tensor):
            parts = {"tensor": value}
            entries[name] = {"kind": "tensor"}
        else:
            raise MinifloatError(f"save takes QuantizedTensors or tensors, got {type(value).__name__} for {name!r}")
        for part, t in parts.items():
            key = f"{name}.{part}"
            if key in flat:
                raise MinifloatError(f"tensor names {name!r} and another both map to the stored key {key!r}; rename one")
            flat[key] = t.detach().to("cpu").contiguous()
            entries[name].setdefault("sha256", {})[part] = _digest(flat[key])
    metadata = {"format": FORMAT_TAG, "entries": json.dumps(entries, sort_keys=True)}
    with atomic_path(path) as tmp:
        save_file(flat, str(tmp), metadata=metadata)


def load(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> dict[str, QuantizedTensor | torch.Tensor]:
    """Read what `save` wrote, verifying every tensor's checksum."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            stored = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as err:  # safetensors raises its own error types for bad headers/sizes
        raise CorruptFileError(f"{path}: not a readable safetensors file ({err}); was it truncated?") from None
    if metadata.get("format") != FORMAT_TAG:
        raise CorruptFileError(f"{path}: not written by minifloat.save (metadata format {metadata.get('format')!r})")
    try:
        entries = json.loads(metadata["entries"])
    except (KeyError, json.JSONDecodeError) as err:
        raise CorruptFileError(f"{path}: damaged minifloat metadata ({err})") from None

    out: dict[str, QuantizedTensor | torch.Tensor] = {}
    for name, entry in entries.items():
        parts = {}
        for part, digest in entry["sha256"].items():
            key = f"{name}.{part}"
            if key not in stored:
                raise CorruptFileError(f"{path}: tensor {key!r} is missing")
            if _digest(stored[key]) != digest:
                raise CorruptFileError(f"{path}: tensor {key!r} does not match its checksum; the file was modified")
            parts[part] = stored[key].to(device)
        if entry["kind"] == "tensor":
            out[name] = parts["tensor"]
        else:
            out[name] = QuantizedTensor(
                parts["data"], parts["scale"], parts.get("tensor_scale"), entry["shape"],
                Scheme.from_dict(entry["scheme"]), getattr(torch, entry["dtype"]),
            )
    return out
