"""A training step per recipe (the built-in GPT: forward, loss, backward, AdamW step) against FP32
and BF16 autocast: step time, tokens/s, speed-up.

Checks: each recipe's logits on the first batch within a relative distance of the FP32 model's
on the same weights — 10 % with 3 mantissa bits, 20 % with 2 (E3M2), 35 % with 1 (FP4), errors
that grow with depth (measured at the small size: 7 %, 14 %, 30 %); a broken quantizer lands near
100 %, and the loss of a random-init model (ln 256 ≈ 5.5) would not show it — and every gradient
finite."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from minifloat.models.gpt import GPT, GPT_SIZES
from minifloat.nn.convert import convert
from minifloat.recipes import RECIPES
from minifloat.validate.runner import Check, Context, Outcome, phase, rel_error

NAME, TITLE = "training", "A training step per recipe"


def run(ctx: Context) -> Outcome:
    size, batch, seq = ctx.pick({"tiny": ("tiny", 2, 32), "default": ("small", 8, 128), "full": ("base", 16, 256)})
    torch.manual_seed(0)
    base = GPT(GPT_SIZES[size]).to(ctx.device)
    ids = torch.randint(0, 256, (batch, seq + 1), device=ctx.device)
    x, y = ids[:, :-1], ids[:, 1:]
    out = Outcome(tensor_bytes=sum(p.nbytes for p in base.parameters()) * 4)  # weights, grads, two AdamW moments
    cases, first, logits = {}, {}, {}
    for name in ("fp32", "bf16", *RECIPES):
        m = copy.deepcopy(base)
        if name not in ("fp32", "bf16"):
            convert(m, name, filter=lambda fqn, mod: fqn != "lm_head")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step(m=m, opt=opt, name=name):
            with phase("forward"), torch.autocast(ctx.device.type, torch.bfloat16, enabled=name == "bf16"):
                loss = F.cross_entropy(m(x).float().flatten(0, 1), y.reshape(-1))
            with phase("backward"):
                loss.backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)
            with phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            return float(loss.detach()), finite

        with torch.no_grad(), torch.autocast(ctx.device.type, torch.bfloat16, enabled=name == "bf16"):
            logits[name] = m(x).float()
        first[name] = step()
        cases[name] = step
    med = ctx.time(cases)
    tokens = batch * seq
    for name, t in med.items():
        loss, finite = first[name]
        err = rel_error(logits[name], logits["fp32"])
        out.rows.append({"precision": name, "median_s": t, "tokens_per_s": tokens / t, "speedup_vs_fp32": med["fp32"] / t,
                         "speedup_vs_bf16": med["bf16"] / t, "first_loss": loss, "logits_rel_error": err})  # fmt: skip
        out.checks.append(Check(f"{name}: every gradient finite", float(finite), 1.0, "=="))
        if name != "fp32":
            limit = 0.35 if "fp4" in name else 0.2 if name == "mxfp6-e3m2" else 0.1  # by mantissa bits: 1, 2, 3
            out.checks.append(Check(f"{name}: logits against FP32's (relative)", err, limit))
    out.notes.append(f"GPT {size}, batch {batch} × {seq} tokens; the LM head stays in high precision")
    out.trace = {k: cases[k] for k in ("fp32", "fp8", "nvfp4")}
    return out
