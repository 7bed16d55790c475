"""`save` / `load`: QuantizedTensors (and plain tensors) in a safetensors file.

No pickle. Each QuantizedTensor ``name`` is stored as the tensors ``name.data``,
``name.scale`` (and ``name.tensor_scale``), with its scheme, shape and dtype in the header's
metadata. The metadata also holds the dtype, shape and SHA-256 of every stored tensor, and a
SHA-256 of itself, so a file whose bytes were changed after saving is rejected, not silently
loaded; each QuantizedTensor's parts must also have the geometry its shape and scheme imply.
Writes are atomic (temp file + rename): an interrupted save leaves the previous file intact.
Files of the first layout (``minifloat/1``: tensor checksums only) still load.

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

import json
import os
from collections.abc import Mapping

import torch

from minifloat.errors import MinifloatError
from minifloat.io.atomic import atomic_path
from minifloat.io.checksum import sha256
from minifloat.quant.tensor import QuantizedTensor, check_parts
from minifloat.scaling.schemes import Scheme

FORMAT_TAG = "minifloat/2"
_OLD_TAG = "minifloat/1"  # entries with {"sha256": {part: digest}} and no digest of the metadata
_PARTS = ("data", "scale", "tensor_scale")


class CorruptFileError(MinifloatError):
    """A file that is not a complete, unmodified minifloat safetensors file."""


def _digest(t: torch.Tensor) -> str:
    return sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: object) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


def save(path: str | os.PathLike[str], tensors: Mapping[str, QuantizedTensor | torch.Tensor]) -> None:
    """Write `tensors` (name → QuantizedTensor or tensor) to `path` atomically."""
    from safetensors.torch import save_file

    if not isinstance(tensors, Mapping):
        raise MinifloatError(f"save takes a mapping of names to tensors, e.g. {{'w': q}}; got {type(tensors).__name__}")
    flat: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    storages: set[int] = set()
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise MinifloatError(f"tensor names must be non-empty strings, got {name!r}")
        if isinstance(value, QuantizedTensor):
            check_parts(value)
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
        entries[name]["parts"] = {}
        for part, t in parts.items():
            key = f"{name}.{part}"
            if key in flat:
                raise MinifloatError(f"tensor names {name!r} and another both map to the stored key {key!r}; rename one")
            t = t.detach().to("cpu").contiguous()
            if t.numel() and t.untyped_storage().data_ptr() in storages:
                t = t.clone()  # tied weights, views: safetensors refuses tensors that share memory
            storages.add(t.untyped_storage().data_ptr())
            flat[key] = t
            entries[name]["parts"][part] = {
                "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "sha256": _digest(flat[key])
            }
    text = json.dumps(entries, sort_keys=True)
    metadata = {"format": FORMAT_TAG, "entries": text, "entries_sha256": sha256(text.encode())}
    with atomic_path(path) as tmp:
        save_file(flat, str(tmp), metadata=metadata)


def load(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> dict[str, QuantizedTensor | torch.Tensor]:
    """Read what `save` wrote, verifying the metadata's and every tensor's checksum and each
    QuantizedTensor's geometry; raises `CorruptFileError` naming what does not match."""
    from safetensors import safe_open

    if os.path.isdir(path):
        raise MinifloatError(f"{path} is a directory; pass the path of a file minifloat.save wrote")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            stored = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as err:  # safetensors raises its own error types for bad headers/sizes
        raise CorruptFileError(f"{path}: not a readable safetensors file ({err}); was it truncated?") from None
    tag = metadata.get("format")
    if tag not in (FORMAT_TAG, _OLD_TAG):
        raise CorruptFileError(
            f"{path}: not written by minifloat.save (metadata format {tag!r}); a plain safetensors file "
            "(no QuantizedTensors) loads with safetensors.torch.load_file"
        )
    text = metadata.get("entries")
    if tag == FORMAT_TAG and (text is None or sha256(text.encode()) != metadata.get("entries_sha256")):
        raise CorruptFileError(f"{path}: the minifloat metadata does not match its checksum; the file was modified")
    try:
        entries = json.loads(text)
        if not isinstance(entries, dict):
            raise ValueError("entries is not a mapping")
    except (TypeError, ValueError) as err:
        raise CorruptFileError(f"{path}: damaged minifloat metadata ({err})") from None

    out: dict[str, QuantizedTensor | torch.Tensor] = {}
    used: set[str] = set()
    for name, entry in entries.items():
        try:  # {part: {"dtype", "shape", "sha256"}}; minifloat/1 entries hold only the digests
            specs = entry["parts"] if tag == FORMAT_TAG else {p: {"sha256": d} for p, d in entry["sha256"].items()}
            out[name] = _rebuild(name, entry, specs, stored, device)
        except CorruptFileError as err:
            raise CorruptFileError(f"{path}: {err}") from None
        except (KeyError, TypeError, ValueError, AttributeError, MinifloatError) as err:
            raise CorruptFileError(f"{path}: damaged minifloat metadata for {name!r} ({err!r})") from None
        used.update(f"{name}.{part}" for part in specs)
    extra = sorted(set(stored) - used)
    if extra:
        raise CorruptFileError(f"{path}: tensors {extra} are not described by the minifloat metadata")
    return out


def _rebuild(name: str, entry: dict, specs: dict, stored: dict[str, torch.Tensor], device) -> QuantizedTensor | torch.Tensor:
    """One saved value from its metadata entry, its parts' specs and the stored tensors, every
    check passed."""
    parts = {}
    for part, spec in specs.items():
        key = f"{name}.{part}"
        if key not in stored:
            raise CorruptFileError(f"tensor {key!r} is missing")
        t = stored[key]
        if "dtype" in spec or "shape" in spec:  # minifloat/2
            if t.dtype != _dtype(spec["dtype"]) or list(t.shape) != spec["shape"]:
                raise CorruptFileError(
                    f"tensor {key!r} is {t.dtype} of shape {list(t.shape)}; it was saved as {spec['dtype']} of "
                    f"shape {spec['shape']}; the file was modified"
                )
        if _digest(t) != spec["sha256"]:
            raise CorruptFileError(f"tensor {key!r} does not match its checksum; the file was modified")
        parts[part] = t
    if entry["kind"] == "tensor":
        if set(parts) != {"tensor"}:
            raise ValueError(f"a plain tensor entry with parts {sorted(parts)}")
        return parts["tensor"].to(device)
    if entry["kind"] != "quantized" or not set(parts) <= set(_PARTS):
        raise ValueError(f"unknown entry kind {entry['kind']!r} with parts {sorted(parts)}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"shape {shape!r}")
    q = QuantizedTensor(
        parts["data"], parts["scale"], parts.get("tensor_scale"), shape, Scheme.from_dict(entry["scheme"]),
        _dtype(entry["dtype"]),
    )
    try:
        check_parts(q)
    except MinifloatError as err:
        raise CorruptFileError(f"{name!r}: {err}; the file was modified") from None
    return q.to(device)
