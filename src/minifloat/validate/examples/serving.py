"""Serving: a quantized model's forward per PTQ config, KV-cache decoding per cache format, and
FP4 self-speculative decoding — on the built-in GPT (random weights with a sharpened output
layer, so that greedy choices are not near-ties).

Checks: each quantized model's logits within a relative distance of the FP32 model's that its
formats allow through the layers (10 % with 3 mantissa bits, 45 % with FP4 — the 8-layer
`base` GPT of the full size measured 35 % with MXFP4 weights and activations; a broken
quantizer lands near 100 %); greedy decoding with an FP32
KV cache picks the tokens a full recomputation of every prefix picks (the cache is exact);
greedy speculative decoding with an FP4 draft returns exactly the tokens of plain greedy
decoding (verification keeps the target's choices)."""

from __future__ import annotations

import copy

import torch

from minifloat.infer.generation.decoding import generate
from minifloat.infer.modules.accounting import linear_weight_bytes
from minifloat.infer.ptq.config import QUANT_CONFIGS
from minifloat.infer.quantize import calibrate, quantize_model
from minifloat.models.gpt import GPT, GPT_SIZES
from minifloat.validate.runner import Check, Context, Outcome, phase, rel_error

NAME, TITLE = "serving", "Quantized forward, KV-cache decoding, speculative decoding"
KV = ("fp32", "bf16", "fp8", "mxfp8", "nvfp4")


def run(ctx: Context) -> Outcome:
    size, batch, seq, new = ctx.pick({"tiny": ("tiny", 2, 32, 12), "default": ("small", 4, 128, 48), "full": ("base", 8, 256, 128)})
    torch.manual_seed(0)
    model = GPT(GPT_SIZES[size]).eval().to(ctx.device)
    with torch.no_grad():
        model.ln_f.weight.mul_(20.0)  # peaked next-token distributions
    ids = torch.randint(0, 256, (batch, seq)).to(ctx.device)
    out = Outcome(tensor_bytes=sum(p.nbytes for p in model.parameters()))
    cal = calibrate(model, [ids])
    with torch.no_grad():
        ref = model(ids)
        cases = {"fp32 forward": lambda: model(ids)}
        for name in QUANT_CONFIGS:
            q = copy.deepcopy(model)
            with phase("quantize"):
                quantize_model(q, name, calibration=cal)
            err = rel_error(q(ids), ref)
            limit = 0.45 if "fp4" in name else 0.1
            out.rows.append({"case": f"forward {name}", "weight_bytes": linear_weight_bytes(q), "rel_error_vs_fp32": err})
            out.checks.append(Check(f"forward {name}: logits against FP32's (relative)", err, limit))
            cases[f"forward {name}"] = lambda q=q: q(ids)
        med = ctx.time(cases)
    for r in out.rows:
        r |= {"median_s": med[r["case"]], "speedup_vs_fp32": med["fp32 forward"] / med[r["case"]]}
    prompt = ids[:1, :8]
    # KV-cache decoding: the FP32 cache against recomputing every prefix
    plain = {}
    for fmt in KV:
        g = generate(model, prompt, new, kv_cache=fmt)
        plain[fmt] = g
        out.rows.append({"case": f"decode, KV {fmt}", "tokens_per_s": g.tokens_per_s, "kv_bytes": g.kv_bytes,
                         "same_tokens_as_fp32_cache": bool(torch.equal(g.tokens, plain["fp32"].tokens))})  # fmt: skip
    seq_ = prompt
    with torch.no_grad():
        for _ in range(new):
            seq_ = torch.cat((seq_, model(seq_)[:, -1].argmax(-1, keepdim=True)), 1)
    differ = int((seq_ != plain["fp32"].tokens).sum())
    out.checks.append(Check("greedy with an FP32 KV cache against full recomputation: tokens that differ", differ, 0, "=="))
    for draft in ("nvfp4", "mxfp4"):
        g = generate(model, prompt, new, kv_cache="fp32", draft=draft, draft_tokens=4)
        differ = int((g.tokens != plain["fp32"].tokens).sum())
        out.rows.append({"case": f"speculative, {draft} draft", "tokens_per_s": g.tokens_per_s, "mean_accepted": g.mean_accepted,
                         "acceptance": g.accepted / max(g.proposed, 1), "target_forwards": g.target_forwards})  # fmt: skip
        out.checks.append(Check(f"speculative ({draft} draft) against plain greedy: tokens that differ", differ, 0, "=="))
    out.notes.append(f"GPT {size}; forward on {batch} × {seq} tokens; decoding {new} tokens after an 8-token prompt")
    out.trace = {"forward nvfp4": cases["forward nvfp4"], "decode fp8": lambda: generate(model, prompt, 8, kv_cache="fp8"),
                 "speculative": lambda: generate(model, prompt, 8, kv_cache="fp32", draft="nvfp4")}  # fmt: skip
    return out
