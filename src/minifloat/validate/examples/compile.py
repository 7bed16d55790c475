"""FP8 with torch.compile: an MLP stack's training step (forward and backward) in FP16 (autocast,
FP32 weights) and in FP8 (the delayed-scaling recipe),
eager and compiled — the documents' table. minifloat's Linear is opaque to the compiler (its
kernels are compiled C), so compiling fuses what lies around the GEMMs.

Checks: compiled FP8 equals eager FP8 bit for bit (the same kernels run); compiled FP16 is no
further from the FP32 step than twice eager FP16's distance (the compiler keeps some FP16
intermediates in FP32 and fuses differently, so the two FP16 results differ by FP16 roundings)."""

from __future__ import annotations

import copy

import torch

from minifloat.nn.convert import convert
from minifloat.validate.runner import Check, Context, Outcome, phase, rel_error

NAME, TITLE = "compile", "FP16 and FP8, eager and torch.compile"


def mlp(d: int, ff: int, depth: int) -> torch.nn.Sequential:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.LayerNorm(d), torch.nn.Linear(d, ff), torch.nn.GELU(), torch.nn.Linear(ff, d)]
    return torch.nn.Sequential(*layers)


def run(ctx: Context) -> Outcome:
    d, ff, tokens, depth = ctx.pick({"tiny": (64, 128, 32, 1), "default": (512, 2048, 512, 2), "full": (4096, 16384, 4096, 2)})
    torch.manual_seed(0)
    base = mlp(d, ff, depth).to(ctx.device)
    x = torch.randn(tokens, d, device=ctx.device)
    out = Outcome(tensor_bytes=x.nbytes + sum(p.nbytes for p in base.parameters()))
    cases, results = {}, {}
    for prec in ("fp16", "fp8"):
        eager = copy.deepcopy(base)
        if prec == "fp8":
            convert(eager, "fp8")
        twin = copy.deepcopy(eager)
        compiled = torch.compile(twin)
        for mode, m, owner in (("eager", eager, eager), ("compiled", compiled, twin)):

            def step(m=m, owner=owner, prec=prec):
                owner.zero_grad(set_to_none=True)
                with phase("forward"), torch.autocast(ctx.device.type, torch.float16, enabled=prec == "fp16"):
                    y = m(x)
                with phase("backward"):
                    y.float().square().mean().backward()
                return y.detach()

            with phase("compile" if mode == "compiled" else "first call"):
                results[(prec, mode)] = (step(), next(iter(owner.parameters())).grad.clone())
            cases[f"{prec} {mode}"] = step
    med = ctx.time(cases)
    flops = 3 * 2 * tokens * 2 * d * ff * depth
    for key, t in med.items():
        out.rows.append({"case": key, "median_s": t, "tflops": flops / t / 1e12,
                         "speedup_vs_fp16_eager": med["fp16 eager"] / t, "speedup_vs_eager": med[key.replace("compiled", "eager")] / t})  # fmt: skip
    def dist(a, b):
        return max(rel_error(a[i], b[i]) for i in (0, 1))

    ref = copy.deepcopy(base)
    y = ref(x)
    y.square().mean().backward()
    fp32 = (y.detach(), next(iter(ref.parameters())).grad)
    out.checks.append(Check("fp8: compiled against eager (output, gradient; relative)",
                            dist(results[("fp8", "compiled")], results[("fp8", "eager")]), 0.0))  # fmt: skip
    eager16 = dist(results[("fp16", "eager")], fp32)
    out.checks.append(Check(f"fp16: compiled's distance to FP32 (eager's: {eager16:.2e})",
                            dist(results[("fp16", "compiled")], fp32), 2 * eager16))  # fmt: skip
    out.trace = {k: cases[k] for k in ("fp8 eager", "fp8 compiled")}
    return out
