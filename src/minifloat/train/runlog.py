"""The run log ``log.jsonl`` — one strict JSON record per step (`minifloat.io.jsonio`) — and the
rule that protects a folder's earlier results: refuse, or delete them when asked.

A killed run may leave a torn last line; `read_log` stops there, and `rewind_log` cuts the
log back to a checkpoint's step when a run resumes, so no step is logged twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from minifloat.errors import MinifloatError
from minifloat.io import jsonio
from minifloat.io.atomic import atomic_path, remove


def read_log(path: str | Path) -> list[dict]:
    """The JSONL records of a run (a torn last line from a killed run ends them)."""
    return [rec for _, rec in log_lines(Path(path))]


def log_lines(path: Path) -> list[tuple[str, dict]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append((line, jsonio.loads(line)))
        except json.JSONDecodeError:
            break
    return out


def rewind_log(path: Path, step: int) -> dict:
    """On resume from the checkpoint of `step`: keep the log's records up to it and return the
    last. A run killed after logging later steps (or mid-line) would otherwise have them twice,
    and a torn line would hide every record after it."""
    keep = [(line, rec) for line, rec in log_lines(path) if rec.get("step", 0) <= step]
    text = "".join(line + "\n" for line, _ in keep)
    if path.exists() and path.read_text() != text:
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return keep[-1][1] if keep else {}


def append_record(path: Path, record: dict) -> None:
    """Append one step's `record` to the log at `path`."""
    with open(path, "a") as f:
        f.write(jsonio.dumps(record) + "\n")


def clear_previous(found: list[Path], overwrite: bool, *, held: str, remedy: str, delete: bool = True) -> None:
    """Refuse to write over an earlier run's results `found` (the paths of them that exist),
    naming them (`held`) and the way out (`remedy`); or, with `overwrite`, delete them (where
    `delete`: under FSDP only rank 0 does)."""
    if not found:
        return
    if not overwrite:
        raise MinifloatError(f"{found[0].parent} already holds {held}; pass {remedy}")
    if delete:
        for path in found:
            remove(path)
