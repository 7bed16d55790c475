"""A scaled GEMM per precision: FP32, BF16, FP16 matmuls and the quantized ones (FP8 per tensor,
row and block, MXFP8, MXFP6, MXFP4, NVFP4) — native ``torch._scaled_mm`` where the device has
the format, the exact emulation elsewhere. TFLOP/s, speed-up against FP32 and BF16, and the
error against the float64 product of the original operands.

Checks: a float matmul's error against float64 within its dtype's reach; a quantized GEMM equal
to the float64 product of its dequantized operands up to FP32 accumulation (the emulation's
contract; a native GEMM within 1e-3, or 2^-8 where it writes bfloat16: cuBLAS' row- and
block-scaled FP8 GEMMs do). A native case is timed twice: with the activation quantized each
call (what a training step pays) and the GEMM alone (`… gemm only`)."""

from __future__ import annotations

import torch

from minifloat.gemm import choose_backend, scaled_mm
from minifloat.quant.api import quantize
from minifloat.scaling.schemes import get_scheme
from minifloat.validate.runner import Check, Context, Outcome, phased, rel_error

NAME, TITLE = "gemm", "Scaled GEMM per precision"
# precision → (activation scheme, weight scheme)
QUANTIZED = {"fp8 tensor": ("fp8", "fp8"), "fp8 row": ("fp8_rowwise", "fp8_rowwise"),
             "fp8 block": ("fp8_block128", "fp8_block128x128"), "mxfp8": ("mxfp8", "mxfp8"),
             "mxfp6": ("mxfp6_e2m3", "mxfp6_e2m3"), "mxfp4": ("mxfp4", "mxfp4"), "nvfp4": ("nvfp4", "nvfp4")}  # fmt: skip
FLOAT_LIMIT = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}


def run(ctx: Context) -> Outcome:
    m, n, k = ctx.pick({"tiny": (64, 128, 256), "default": (1024, 2048, 2048), "full": (8192, 8192, 8192)})
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g).to(ctx.device), torch.randn(n, k, generator=g).to(ctx.device)
    ref = a.double() @ b.double().T
    out = Outcome(tensor_bytes=a.nbytes + b.nbytes)
    cases, errors, exact = {}, {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        ad, bd = a.to(dtype), b.to(dtype)
        cases[name] = lambda ad=ad, bd=bd: phased("gemm", torch.matmul, ad, bd.T)
        errors[name] = rel_error(ad @ bd.T, ref)
    backends = {}
    for name, (sa, sb) in QUANTIZED.items():
        qa, qb = quantize(a, get_scheme(sa)), quantize(b, get_scheme(sb))
        backends[name] = choose_backend([qa.scheme, qb.scheme], ctx.device)
        cases[name] = lambda sa=sa, qb=qb: phased("gemm", scaled_mm, phased("quantize", quantize, a, get_scheme(sa)), qb, backend="auto")
        if backends[name] == "native":
            cases[f"{name} gemm only"] = lambda qa=qa, qb=qb: phased("gemm", scaled_mm, qa, qb, backend="native")
        y = scaled_mm(qa, qb, backend="auto")
        errors[name] = rel_error(y, ref)
        exact[name] = rel_error(y, qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).T)
        out.tensor_bytes += qa.nbytes + qb.nbytes
    med = ctx.time(cases)
    flops = 2 * m * n * k
    for name, t in med.items():
        out.rows.append({"precision": name, "backend": backends.get(name.removesuffix(" gemm only"), "torch"), "median_s": t, "tflops": flops / t / 1e12,
                         "speedup_vs_fp32": med["fp32"] / t, "speedup_vs_bf16": med["bf16"] / t,
                         "rel_error_vs_fp64": errors.get(name), "rel_error_vs_dequantized": exact.get(name)})  # fmt: skip
    for name, limit in FLOAT_LIMIT.items():
        out.checks.append(Check(f"{name} matmul: relative error against float64", errors[name], limit))
    for name in QUANTIZED:
        bf16_out = get_scheme(QUANTIZED[name][0]).granularity != "tensor"  # cuBLAS writes these in bfloat16
        limit = 1e-5 if backends[name] == "emulated" else 2**-8 if bf16_out else 1e-3
        out.checks.append(Check(f"{name} ({backends[name]}): error against the dequantized operands' float64 product",
                                exact[name], limit))  # fmt: skip
    out.notes.append(f"shape m={m}, n={n}, k={k}; the quantized cases include quantizing the activation each call")
    out.trace = {name: cases[name] for name in ("fp32", "fp8 row", "mxfp4", "nvfp4")}
    return out
