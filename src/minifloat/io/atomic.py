"""Atomic file writes: a file is either the old one or the complete new one, never half."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from minifloat.errors import MinifloatError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is fsynced and renamed over `path`,
    and the rename is fsynced too.

    Example::

        with atomic_path("out.png") as tmp:
            figure.savefig(tmp)
    """
    target = Path(path)
    if target.is_dir():
        raise MinifloatError(f"{target} is a directory; pass a file path inside it, e.g. {target / 'out'}{target.suffix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_beside(target)
    try:
        # The mode a plain open() would give: the umask's for a new file (as the fresh temporary
        # has it), the old file's when replacing one. Set after writing, since a writer may
        # replace the temporary with its own 0600 file (safetensors' save_file does).
        mode = stat.S_IMODE((target if target.exists() else tmp).stat().st_mode)
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)  # the rename itself survives a crash, before anything relies on it
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Flush `path`'s directory entries to disk: a rename is durable only once its folder is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete the file or the folder tree at `path`, if there is one (`--overwrite`)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def make_dir_beside(target: Path, prefix: str) -> Path:
    """A new empty folder with a unique hidden name in `target`'s folder, mode 0777 less the
    umask, as mkdir gives (tempfile.mkdtemp's is 0700: a folder renamed into place from it
    would be private)."""
    return _unique_beside(target, lambda tag: f".{prefix}{tag}", lambda p: p.mkdir(0o777))


def replace_dir(tmp: Path, target: Path) -> None:
    """Put the finished folder `tmp` (from `make_dir_beside`) in place of `target`: its files get
    the mode a plain open() gives (`new_file_mode`) and reach the disk, then the rename does."""
    mode = new_file_mode(tmp)
    for f in tmp.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fchmod(fh.fileno(), mode)
                os.fsync(fh.fileno())
    if target.exists():
        remove(target)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def new_file_mode(folder: Path) -> int:
    """The mode a plain open() gives a new file, for a `folder` made by `make_dir_beside` (0777
    less the umask): 0666 less the umask. Writers that make their files 0600 (safetensors'
    save_file) are given it back, so that a serving process of another user can read them."""
    return stat.S_IMODE(folder.stat().st_mode) & 0o666


def _create_beside(target: Path) -> Path:
    """A new empty file with a unique hidden name in `target`'s folder, mode 0666 less the umask."""
    return _unique_beside(
        target, lambda tag: f".{target.name}.{tag}{target.suffix}",
        lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)),
    )  # fmt: skip


def _unique_beside(target: Path, name: Callable[[str], str], create: Callable[[Path], object]) -> Path:
    """`create` a path named `name(random tag)` beside `target`, retrying names that exist."""
    for _ in range(100):
        tmp = target.parent / name(secrets.token_hex(4))
        try:
            create(tmp)
            return tmp
        except FileExistsError:
            continue
    raise MinifloatError(f"could not create a temporary file or folder beside {target}")
