"""Byte-level text corpora: the embedded default and user files.

The default is built at run time from the Python standard library's own ``.py`` sources on
this machine — a fixed, sorted selection (tests and site-packages excluded) of a few MB,
nothing downloaded. Tokens are bytes (vocabulary 256). The split is deterministic: the last
10 % of the bytes are the validation set.

Example:
    >>> data = stdlib_corpus(max_bytes=100_000)
    >>> data.train.dtype, len(data.train) + len(data.val), data.source.startswith("python stdlib")
    (torch.uint8, 100000, True)
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from minifloat.errors import MinifloatError

VOCAB_SIZE = 256
VAL_FRACTION = 0.1
DEFAULT_MAX_BYTES = 4_000_000
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
_TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".csv", ".tex", ".html", ".c", ".h", ".js"}


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    source: str  # what it was built from
    sha256: str  # of the whole byte string, for the report
    starts: tuple[int, ...] = (0,)  # where each document begins in train + val (byte offsets, ascending)

    def documents(self, split: str) -> list[bytes]:
        """The split's bytes cut where documents begin (a document the split boundary cuts: its part)."""
        data, offset = (self.train, 0) if split == "train" else (self.val, len(self.train))
        cuts = sorted({0, len(data)} | {s - offset for s in self.starts if 0 < s - offset < len(data)})
        raw = bytes(data.numpy())
        return [raw[a:b] for a, b in itertools.pairwise(cuts) if b > a]


def _split(chunks: list[bytes], source: str) -> Corpus:
    raw = b"".join(chunks)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = max(int(len(data) * VAL_FRACTION), 1)
    starts = tuple(itertools.accumulate((len(c) for c in chunks[:-1]), initial=0))
    return Corpus(data[:-n_val].clone(), data[-n_val:].clone(), source, hashlib.sha256(raw).hexdigest(), starts)


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> list[bytes]:
    """The embedded default's documents: sorted stdlib sources, one a file, up to `max_bytes` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts)) and p.is_file()
    )
    chunks, total = [], 0
    for path in files:
        text = path.read_bytes()[: max_bytes - total]
        chunks.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise MinifloatError(f"the Python standard library at {root} has too little source for a corpus; use --data PATH")
    return chunks


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The embedded default: sorted stdlib sources, concatenated up to `max_bytes`."""
    chunks = stdlib_documents(max_bytes)
    root = Path(sysconfig.get_paths()["stdlib"])
    return _split(chunks, f"python stdlib {root} ({sum(map(len, chunks)):,} bytes)")


def load_corpus(path: str | Path, max_bytes: int | None = None, *, option: str = "--data") -> Corpus:
    """A UTF-8 text file, or a folder of them (sorted, recursively), as a corpus; `option` is the
    command-line option that named it, for the errors (``--calib`` for calibration text)."""
    chunks = read_documents(path, max_bytes, option=option)
    return _split(chunks, f"{path} ({sum(map(len, chunks)):,} bytes)")


def read_documents(path: str | Path, max_bytes: int | None = None, *, option: str = "--data") -> list[bytes]:
    """The UTF-8 text of a file, or of each file of a folder (sorted, recursively): one document a
    file, `max_bytes` in all at most (a large folder or file is not read whole)."""
    path = Path(path)
    if not path.exists():
        raise MinifloatError(f"{option} {path}: no such file or folder")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES)
        if not files:
            raise MinifloatError(f"{option} {path}: no text files ({', '.join(sorted(_TEXT_SUFFIXES))}) in the folder")
    else:
        files = [path]
    chunks, total = [], 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break  # enough
        limit = -1 if max_bytes is None else max_bytes - total
        try:
            with open(f, "rb") as fh:
                raw = fh.read(limit)
        except OSError as err:
            raise MinifloatError(f"{option} {f}: cannot be read ({err.strerror}); check its permissions") from None
        if b"\x00" in raw:
            raise MinifloatError(f"{option} {f}: binary file (contains NUL bytes); give UTF-8 text")
        try:  # a character cut by the read at max_bytes is not an error; one cut by the file's end is
            codecs.getincrementaldecoder("utf-8")().decode(raw, final=limit < 0 or len(raw) < limit)
        except UnicodeDecodeError as err:
            raise MinifloatError(f"{option} {f}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        chunks.append(raw)
        total += len(raw)
    if total < 2 * 1024:
        raise MinifloatError(f"{option} {path}: only {total} bytes of text; give at least 2 KiB")
    return chunks


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random windows of `data`: inputs (B, T) and next-byte targets (B, T), int64."""
    if len(data) < seq_len + 1:
        raise MinifloatError(
            f"the corpus split has {len(data)} bytes; --seq-len {seq_len} needs at least {seq_len + 1}: "
            "give more text or a smaller --seq-len"
        )
    # Every window of seq_len + 1 bytes, the last one ending on the split's last byte.
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()  # (B, T+1)
    return window[:, :-1], window[:, 1:]
