"""FP4 and FP6 for inference, under the documents' names: an FP4 tensor, an FP4 Linear and an FP4
MLP with packed weights (their memory against BF16, measured from the bytes held), and the
error of FP6 E3M2 / E2M3 next to FP4 and FP8 on the same weights.

Checks: packed FP4 weights take ≥ 3.5× less memory than BF16 (4 bits a value and the block
scales: 16 / 4.25 = 3.76× for MXFP4, 16 / 4.5 = 3.56× for NVFP4); the FP4 Linear and MLP
compute exactly what their dequantized weights say (float64 reference); on normal weights the
SQNR follows the mantissa bits, about 6 dB a bit: MXFP6 E2M3 (3 bits) within 1.5 dB of MXFP8 E4M3
(3 bits), ≥ 3 dB over E3M2 (2 bits), which is ≥ 3 dB over MXFP4 E2M1 (1 bit)."""

from __future__ import annotations

import copy

import torch

from minifloat.infer.modules.linear import QuantizedLinear
from minifloat.infer.quantize import model_bytes
from minifloat.measure.error_analysis import sqnr_db
from minifloat.quant.api import quantize
from minifloat.scaling.schemes import get_scheme
from minifloat.validate.runner import Check, Context, Outcome, phased, rel_error

NAME, TITLE = "fp4_inference", "FP4 tensor, FP4 Linear, FP4 MLP; FP6 next to FP4 and FP8"


def run(ctx: Context) -> Outcome:
    d, ff, tokens = ctx.pick({"tiny": (128, 512, 16), "default": (1024, 4096, 256), "full": (4096, 16384, 2048)})
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(ff, d, generator=g) / d**0.5).to(ctx.device)
    x = torch.randn(tokens, d, generator=g).to(ctx.device)
    out = Outcome(tensor_bytes=w.nbytes + x.nbytes)
    bf16_bytes = w.numel() * 2
    for name in ("mxfp4", "nvfp4"):  # the FP4 tensor
        q = phased("quantize", quantize, w, get_scheme(name))
        out.rows.append({"case": f"FP4 tensor {name}", "bytes": q.nbytes, "bf16_bytes": bf16_bytes,
                         "memory_vs_bf16": bf16_bytes / q.nbytes, "sqnr_db": sqnr_db(w.cpu(), q.dequantize(torch.float32).cpu())})  # fmt: skip
        out.checks.append(Check(f"FP4 tensor {name}: times less memory than BF16", bf16_bytes / q.nbytes, 3.5, ">="))
    # the FP4 Linear and MLP (weight-only: the input stays high precision), against BF16 ones
    fc, proj = torch.nn.Linear(d, ff).to(ctx.device), torch.nn.Linear(ff, d).to(ctx.device)
    mlp = torch.nn.Sequential(fc, torch.nn.GELU(), proj)
    bf16_mlp, xb = copy.deepcopy(mlp).to(torch.bfloat16), x.bfloat16()
    cases = {"bf16 MLP": lambda: phased("gemm", bf16_mlp, xb)}
    for config in ("mxfp4-weight-only", "nvfp4-weight-only"):
        q_fc, q_proj = (QuantizedLinear.from_linear(m, config) for m in (fc, proj))
        q_mlp = torch.nn.Sequential(q_fc, torch.nn.GELU(), q_proj)
        with torch.no_grad():
            y_lin, y = q_fc(x), q_mlp(x)
            wf, wp = (m.weight.dequantize(torch.float64) for m in (q_fc, q_proj))
            ref_lin = x.double() @ wf.T + fc.bias.double()
            ref = torch.nn.functional.gelu(ref_lin) @ wp.T + proj.bias.double()
            y_fp32 = mlp(x)
        err_lin, err = rel_error(y_lin, ref_lin), rel_error(y, ref)
        ratio = model_bytes(torch.nn.Sequential(fc, proj)) / 2 / model_bytes(q_mlp)
        out.rows.append({"case": f"FP4 MLP {config}", "bytes": model_bytes(q_mlp), "bf16_bytes": model_bytes(torch.nn.Sequential(fc, proj)) // 2,
                         "memory_vs_bf16": ratio, "rel_error_vs_fp32_mlp": rel_error(y, y_fp32)})  # fmt: skip
        out.checks.append(Check(f"FP4 Linear {config}: error against its dequantized weight (float64)", err_lin, 1e-5))
        out.checks.append(Check(f"FP4 MLP {config}: error against its dequantized weights (float64)", err, 1e-5))
        cases[f"{config} MLP"] = lambda m=q_mlp: phased("gemm", m, x)
        out.tensor_bytes += model_bytes(q_mlp)
    with torch.no_grad():
        med = ctx.time(cases)
    for r in out.rows:
        key = r["case"].replace("FP4 MLP ", "") + " MLP"
        if key in med:
            r |= {"median_s": med[key], "speedup_vs_bf16": med["bf16 MLP"] / med[key]}
    # FP6 next to FP4 and FP8 on the same weights
    db = {}
    for name in ("mxfp8", "mxfp6_e2m3", "mxfp6_e3m2", "nvfp4", "mxfp4"):
        q = quantize(w, get_scheme(name))
        db[name] = sqnr_db(w.cpu(), q.dequantize(torch.float32).cpu())
        out.rows.append({"case": f"weights in {name}", "bits_per_element": q.bits_per_element, "sqnr_db": db[name]})
    out.checks.append(Check("|SQNR mxfp8 − mxfp6_e2m3| (dB): both 3 mantissa bits", abs(db["mxfp8"] - db["mxfp6_e2m3"]), 1.5))
    out.checks.append(Check("SQNR mxfp6_e2m3 − mxfp6_e3m2 (dB)", db["mxfp6_e2m3"] - db["mxfp6_e3m2"], 3.0, ">="))
    out.checks.append(Check("SQNR mxfp6_e3m2 − mxfp4 (dB)", db["mxfp6_e3m2"] - db["mxfp4"], 3.0, ">="))
    out.trace = {"nvfp4 MLP": cases["nvfp4-weight-only MLP"], "bf16 MLP": cases["bf16 MLP"]}
    return out
