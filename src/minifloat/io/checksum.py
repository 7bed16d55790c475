"""SHA-256 digests, the checksums that verified loads compare against.

Example:
    >>> sha256(b"")[:16]
    'e3b0c44298fc1c14'
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256(data: bytes) -> str:
    """The hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | Path) -> str:
    """The hex SHA-256 of the file at `path`, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
