"""Build the optional fused CPU kernels. A failed compile only warns (optional=True): the
library then runs its pure-PyTorch reference and says so once at run time."""

import os

from setuptools import Extension, setup

# Built from source on the machine that runs it (make demo / make test), so tune for it;
# MINIFLOAT_PORTABLE=1 builds for any x86-64.
arch = [] if os.environ.get("MINIFLOAT_PORTABLE") else ["-march=native"]

setup(
    ext_modules=[
        Extension(
            "minifloat.kernels._cpu",
            sources=["src/minifloat/kernels/_cpu.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi", *arch],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
