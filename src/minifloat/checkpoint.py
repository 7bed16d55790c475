"""Checkpoints: precision-agnostic, atomic, verified.

A checkpoint is a folder ``ckpt-<step>/`` with

- ``model.safetensors``: the high-precision weights and buffers (delayed-scaling amax
  histories included), each tensor with a SHA-256 (`minifloat.save`), so a run trained in FP8
  resumes in NVFP4 or BF16;
- ``state.pt``: optimizer, loss scaler, RNG states and data position — tensors and plain
  Python values only, read back with ``torch.load(weights_only=True)``;
- ``manifest.json``: the step, the run's config and the SHA-256 of both files.

It is written into a temporary folder and renamed into place; then ``latest`` (a one-line file,
itself replaced atomically) points to it; only then are checkpoints beyond the newest `keep`
removed. A crash at any moment leaves the last complete checkpoint in force. (Saving a step whose folder
exists names the new folder ``ckpt-<step>.1`` and removes the old one after ``latest`` moves.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.io.atomic import atomic_path, fsync_dir, make_dir_beside
from minifloat.io.checksum import file_sha256
from minifloat.quant.serialization import CorruptFileError, load, save

_FILES = ("model.safetensors", "state.pt")  # what the manifest's checksums cover


def save_checkpoint(root: str | Path, step: int, weights: dict[str, torch.Tensor], state: dict, config: dict,
                    keep: int = 1) -> Path:  # fmt: skip
    """Write checkpoint `step` under `root` atomically, point ``latest`` at it, then keep the newest
    `keep` checkpoints (this one among them)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".ckpt-tmp-*"):  # what a killed save left behind
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"ckpt-{step:08d}"
    tmp = make_dir_beside(final, "ckpt-tmp-")
    try:
        save(tmp / "model.safetensors", weights)
        torch.save(state, tmp / "state.pt")
        manifest = {
            "format": "minifloat-checkpoint-1",
            "step": step,
            "config": config,
            "sha256": {name: file_sha256(tmp / name) for name in _FILES},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        for name in (*_FILES, "manifest.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        # A folder of this step already there (it may be the one `latest` names) goes only
        # after `latest` names the new one: until then the new one waits under another name.
        replaced = final if final.exists() else None
        if replaced is not None:
            final = _free_name(final)
        os.replace(tmp, final)
        fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    with atomic_path(root / "latest") as t:
        t.write_text(final.name + "\n")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    for old in checkpoints(root)[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoint folders under `root` (with a manifest), oldest first."""
    root = Path(root)
    found = sorted(
        (int(m[1]), int(m[2] or 0), p)
        for p in (root.iterdir() if root.is_dir() else ())
        if (m := re.fullmatch(r"ckpt-(\d+)(?:\.(\d+))?", p.name)) and (p / "manifest.json").is_file()
    )
    return [p for *_, p in found]


def _free_name(path: Path) -> Path:
    """`path` with the first free suffix ``.1``, ``.2``, ..."""
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


# The model a `minifloat train MODEL` output folder delivers, beside its checkpoints: the merged
# model of a LoRA run (--merge), or a full fine-tune's model (transformers folders), first found wins.
RUN_MODELS = ("merged", "model")


def run_model(path: str | Path) -> Path | None:
    """The transformers folder a fine-tune's output folder `path` holds (`RUN_MODELS`), or None."""
    path = Path(path)
    return next((path / sub for sub in RUN_MODELS if path.is_dir() and (path / sub / "config.json").is_file()), None)


def latest_checkpoint(root: str | Path, verify: bool = True) -> Path | None:
    """The folder ``latest`` points to under `root`, None when there is no checkpoint.

    Without ``latest`` (deleted, or the folders copied without it), the newest folder that holds
    a manifest, with a warning; `load_checkpoint` then verifies it as any other."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.exists():
        found = checkpoints(root)
        if not found:
            return None
        if verify:
            warnings.warn(f"{root} has no 'latest' pointer; using the newest checkpoint, {found[-1].name}", stacklevel=2)
        return found[-1]
    path = root / pointer.read_text().strip()
    if verify and not path.is_dir():
        raise MinifloatError(f"{pointer} points to {path.name}, which does not exist; the checkpoint folder was altered")
    return path


def load_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(manifest, weights, state) of the checkpoint folder `path`, verified."""
    path = Path(path)
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise MinifloatError(f"{mpath}: missing; {path} is not a complete minifloat checkpoint") from None
    except json.JSONDecodeError as err:
        raise CorruptFileError(f"{mpath}: corrupted ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "minifloat-checkpoint-1":
        raise CorruptFileError(f"{mpath}: not a minifloat checkpoint manifest")
    digests = manifest.get("sha256")
    if not isinstance(digests, dict) or not set(_FILES) <= set(digests):  # both verified, always
        raise CorruptFileError(f"{mpath}: the checksums of {', '.join(_FILES)} are missing; the manifest was altered")
    for name, digest in digests.items():
        f = path / name
        if not f.exists():
            raise CorruptFileError(f"{f}: missing from the checkpoint")
        if file_sha256(f) != digest:
            raise CorruptFileError(f"{f}: checksum mismatch — the file is corrupted or was modified")
    weights = load(path / "model.safetensors")
    try:
        state = torch.load(path / "state.pt", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a corrupt file
        raise CorruptFileError(f"{path / 'state.pt'}: cannot be read safely ({err})") from None
    return manifest, weights, state
