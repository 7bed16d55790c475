"""Build the optional fused CPU kernels. A failed compile only warns (optional=True): the
library then runs its pure-PyTorch reference and says so once at run time.

The default build runs on any CPU of its architecture: every object is compiled for the
baseline ISA, and the wider paths (AVX2, AVX-512) are compiled by target pragmas and attributes
and chosen at run time (kernels/cpu.py, kernels/gemv.py). MINIFLOAT_NATIVE=1 compiles every
object with -march=native instead, for the building machine only; `minifloat info` shows which.
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup

KERNELS = "src/minifloat/kernels/"
# The quantize kernels (compiled three times: _cpu.c as is, and included by each ISA variant), the
# decode kernels (minifloat.kernels.cpu, minifloat.kernels.gemv) and the decode loop over them
# (minifloat.infer.generation.fused); the header they share is hashed with them.
SOURCES = [KERNELS + s for s in ("_cpu.c", "_cpu_avx2.c", "_cpu_avx512.c", "_gemv.c", "_decode.c")]
HEADERS = [KERNELS + "_gemv.h"]
# The build records which sources it came from; minifloat.kernels.cpu refuses a library built
# from other versions of them (a checkout updated without a rebuild) and runs the reference.
source_hash = hashlib.sha256(b"".join((Path(__file__).parent / s).read_bytes() for s in SOURCES + HEADERS)).hexdigest()[:16]

native = os.environ.get("MINIFLOAT_NATIVE", "") not in ("", "0")
arch = ["-march=native"] if native else []

setup(
    ext_modules=[
        Extension(
            "minifloat.kernels._cpu",
            sources=SOURCES,
            depends=HEADERS,
            define_macros=[("MF_SOURCE_HASH", f'"{source_hash}"'), ("MF_BUILD", '"native"' if native else '"portable"')],
            extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi", *arch],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
