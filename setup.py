"""Build the optional fused CPU kernels. A failed compile only warns (optional=True): the
library then runs its pure-PyTorch reference and says so once at run time."""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup

# The quantize kernels and the decode kernels (minifloat.kernels.cpu, minifloat.kernels.gemv).
SOURCES = ["src/minifloat/kernels/_cpu.c", "src/minifloat/kernels/_gemv.c"]
# The build records which sources it came from; minifloat.kernels.cpu refuses a library built
# from other versions of them (a checkout updated without a rebuild) and runs the reference.
source_hash = hashlib.sha256(b"".join((Path(__file__).parent / s).read_bytes() for s in SOURCES)).hexdigest()[:16]

# Built from source on the machine that runs it (make demo / make test), so tune for it;
# MINIFLOAT_PORTABLE=1 builds for any x86-64.
arch = [] if os.environ.get("MINIFLOAT_PORTABLE") else ["-march=native"]

setup(
    ext_modules=[
        Extension(
            "minifloat.kernels._cpu",
            sources=SOURCES,
            define_macros=[("MF_SOURCE_HASH", f'"{source_hash}"')],
            extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi", *arch],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
