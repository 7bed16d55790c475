"""`keep_freed_memory`: a large buffer comes from the heap and stays there once freed (glibc's
own accounting, `mallinfo2`), instead of being mapped and unmapped on every call. Each case
runs in its own interpreter (the setting is process-wide)."""

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

PROBE = """
import ctypes, json, sys
import torch
from minifloat.kernels.allocator import keep_freed_memory, keeps_freed_memory

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
t = torch.empty(16 << 20)  # 64 MiB
mapped_while_live = libc.mallinfo2().hblkhd  # bytes in blocks that malloc mmapped on their own
del t
free_in_heap = libc.mallinfo2().fordblks  # freed bytes malloc kept for reuse
print(json.dumps({"applied": applied, "reported": keeps_freed_memory(),
                  "mapped_while_live": mapped_while_live, "free_in_heap": free_in_heap}))
"""
MIB64 = 64 << 20


def _probe(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_freed_buffers_stay_in_the_heap():
    kept = _probe("keep")
    assert kept["applied"] and kept["reported"]
    assert kept["mapped_while_live"] < MIB64  # served from the heap ...
    assert kept["free_in_heap"] >= MIB64  # ... and kept there once freed, for the next call


def test_default_malloc_maps_large_buffers_on_their_own():
    default = _probe("default")
    assert not default["applied"] and not default["reported"]
    assert default["mapped_while_live"] >= MIB64  # its own mmap, unmapped on free
    assert default["free_in_heap"] < MIB64


def test_the_command_keeps_freed_memory_unless_told_not_to():
    argv = [sys.executable, "-m", "minifloat", "bench", "quantize", "--size", "64x256", "--reps", "1", "--schemes", "fp8"]
    kept = json.loads(subprocess.run([*argv, "--json"], capture_output=True, text=True, check=True).stdout)
    assert kept["keeps_freed_memory"] is True
    plain = subprocess.run([*argv, "--default-allocator"], capture_output=True, text=True, check=True).stdout
    assert "allocator: glibc default" in plain
