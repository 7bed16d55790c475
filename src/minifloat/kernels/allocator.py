"""Keep large freed buffers in the process heap instead of handing them back to the kernel.

PyTorch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap threshold
(adaptive, at most 32 MiB) with a fresh ``mmap`` and ``munmap``s them on free, so every call
that returns a large tensor page-faults its output in again, which costs several times the
writing of it (docs/benchmarks/cpu-kernels.md). Training loops and
benchmarks allocate the same sizes over and over, so keeping those blocks is what a caching
allocator (PyTorch's on CUDA, or jemalloc / tcmalloc on CPU) would do.

This is process-wide, so the library never does it on import; the ``minifloat`` command does
it for its own process, and a script opts in with one call.

Example (process-wide, hence not run here):
    >>> from minifloat.kernels.allocator import keep_freed_memory
    >>> keep_freed_memory()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_applied = False


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Serve allocations below `threshold` bytes from the heap and keep freed memory there
    (glibc ``mallopt`` M_MMAP_THRESHOLD and M_TRIM_THRESHOLD). Returns whether it applied.
    The process's peak memory is unchanged; memory freed after the peak stays with the process."""
    global _applied
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold))) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, int(threshold))
    )
    return _applied


def keeps_freed_memory() -> bool:
    """Whether `keep_freed_memory` applied in this process."""
    return _applied
