"""Atomic file writes: a file is either the old one or the complete new one, never half."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from minifloat.errors import MinifloatError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is fsynced and renamed over `path`.

    Example::

        with atomic_path("out.png") as tmp:
            figure.savefig(tmp)
    """
    target = Path(path)
    if target.is_dir():
        raise MinifloatError(f"{target} is a directory; pass a file path inside it, e.g. {target / 'out'}{target.suffix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # The mode a plain open() would give: the umask's for a new file (mkstemp's would be 0600),
    # the old file's when replacing one.
    tmp = _create_beside(target)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            if target.exists():
                os.fchmod(fh.fileno(), target.stat().st_mode & 0o7777)
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _create_beside(target: Path) -> Path:
    """A new empty file with a unique hidden name in `target`'s folder, mode 0666 less the umask."""
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}{target.suffix}"
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise MinifloatError(f"could not create a temporary file beside {target}")
