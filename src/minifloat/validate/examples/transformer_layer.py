"""A transformer layer (pre-norm attention and MLP, the built-in GPT's block) forward and backward
per precision: FP32, BF16 autocast, and the training recipes. d_model, d_ff, sequence and batch
by size (the documents' d = 4096, ff = 16384, seq = 2048 at ``full``, on a GPU).

Checks: every gradient finite; the output within a relative distance of the FP32 layer's that
the format's precision allows (twice the relative RMS error of rounding a normal tensor to
it, which a quantized GEMM roughly inherits, plus room for the second GEMM's); every Linear
converted (a layer left in FP32 would pass the error check for the wrong reason)."""

from __future__ import annotations

import copy

import torch

from minifloat.models.gpt import Block, GPTConfig
from minifloat.nn.convert import convert
from minifloat.validate.runner import Check, Context, Outcome, phase, rel_error

NAME, TITLE = "transformer_layer", "Transformer layer forward + backward per precision"
PRECISIONS = ("fp32", "bf16", "fp8", "fp8-block", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
# output relative-error limits against the FP32 layer
LIMIT = {"bf16": 0.01, "fp8": 0.05, "fp8-block": 0.05, "mxfp8": 0.05, "mxfp6": 0.05, "mxfp4": 0.15, "nvfp4": 0.15}


def layer(d: int, ff: int, heads: int) -> Block:
    b = Block(GPTConfig(n_embd=d, n_head=heads))
    b.mlp.fc, b.mlp.proj = torch.nn.Linear(d, ff), torch.nn.Linear(ff, d)
    return b


def run(ctx: Context) -> Outcome:
    d, ff, seq, batch, heads = ctx.pick({"tiny": (128, 256, 16, 2, 2), "default": (1024, 4096, 512, 2, 16),
                                         "full": (4096, 16384, 2048, 1, 32)})  # fmt: skip
    torch.manual_seed(0)
    base = layer(d, ff, heads).to(ctx.device)
    x = torch.randn(batch, seq, d, device=ctx.device)
    out = Outcome(tensor_bytes=x.nbytes + sum(p.nbytes for p in base.parameters()))
    with torch.no_grad():
        ref = base(x)
    cases, errs, finite = {}, {}, {}
    for p in PRECISIONS:
        m = copy.deepcopy(base)
        if p not in ("fp32", "bf16"):
            convert(m, p)
            n = sum(type(q) is not torch.nn.Linear for q in m.modules() if isinstance(q, torch.nn.Linear))
            out.checks.append(Check(f"{p}: Linears converted", n, 4, "=="))
        dtype = torch.bfloat16 if p == "bf16" else None

        def step(m=m, dtype=dtype):
            xi = x.clone().requires_grad_(True)
            with phase("forward"), torch.autocast(ctx.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y = m(xi)
            with phase("backward"):
                y.float().square().mean().backward()
            return y, xi.grad

        y, gx = step()
        errs[p] = rel_error(y, ref)
        finite[p] = bool(torch.isfinite(gx).all()) and all(bool(torch.isfinite(q.grad).all()) for q in m.parameters())
        cases[p] = step
    med = ctx.time(cases)
    tokens = batch * seq
    flops = 3 * (2 * tokens * (4 * d * d + 2 * d * ff) + 4 * batch * seq * seq * d)  # fwd + bwd ≈ 3 × fwd
    for p in PRECISIONS:
        out.rows.append({"precision": p, "median_s": med[p], "tflops": flops / med[p] / 1e12, "speedup_vs_fp32": med["fp32"] / med[p],
                         "speedup_vs_bf16": med["bf16"] / med[p], "rel_error_vs_fp32": errs[p]})  # fmt: skip
        out.checks.append(Check(f"{p}: every gradient finite", float(finite[p]), 1.0, "=="))
        if p in LIMIT:
            out.checks.append(Check(f"{p}: output error against the FP32 layer", errs[p], LIMIT[p]))
    out.notes.append(f"d_model={d}, d_ff={ff}, seq={seq}, batch={batch}, heads={heads}")
    out.trace = {p: cases[p] for p in ("fp32", "fp8", "nvfp4")}
    return out
