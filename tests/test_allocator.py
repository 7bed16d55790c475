"""`keep_freed_memory`: a large buffer freed and allocated again is not page-faulted in again.
Each case runs in its own interpreter (the setting is process-wide)."""

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

PROBE = """
import json, resource, sys
import torch
from minifloat.kernels.allocator import keep_freed_memory, keeps_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def faults_of_a_fresh_64_mib_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 << 20).fill_(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del t
    return after - before
first, second = faults_of_a_fresh_64_mib_tensor(), faults_of_a_fresh_64_mib_tensor()
print(json.dumps({"applied": applied, "reported": keeps_freed_memory(), "first": first, "second": second}))
"""


def _probe(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_freed_buffers_stay_in_the_heap():
    kept = _probe("keep")
    assert kept["applied"] and kept["reported"]
    assert kept["first"] > 50  # the first touch faults 64 MiB in (in pages or larger folios)
    assert kept["second"] < kept["first"] // 10  # reused from the heap


def test_default_malloc_faults_large_buffers_in_every_time():
    default = _probe("default")
    assert not default["applied"] and not default["reported"]
    assert default["second"] > default["first"] // 2


def test_the_command_keeps_freed_memory_unless_told_not_to():
    argv = [sys.executable, "-m", "minifloat", "bench", "quantize", "--size", "64x256", "--reps", "1", "--schemes", "fp8"]
    kept = json.loads(subprocess.run([*argv, "--json"], capture_output=True, text=True, check=True).stdout)
    assert kept["keeps_freed_memory"] is True
    plain = subprocess.run([*argv, "--default-allocator"], capture_output=True, text=True, check=True).stdout
    assert "allocator: glibc default" in plain
