"""Quantize and dequantize with every scheme: throughput and error (SQNR against the float64
input), checked against a floor per element format: 3 dB under the least SQNR any scaling of that
element format reaches on a standard normal input (measured once; about 6 dB per mantissa bit:
E4M3 31.5, E5M2 25.4, E3M2 25.4, E2M3 30.9, E2M1 17.3 dB). A quantizer off by one code in a
few per cent of the elements falls below its floor."""

from __future__ import annotations

import torch

from minifloat.measure.error_analysis import sqnr_db
from minifloat.quant.api import dequantize, quantize
from minifloat.scaling.schemes import SCHEMES
from minifloat.validate.runner import Check, Context, Outcome, phased

NAME, TITLE = "quantize", "Quantize / dequantize per scheme: throughput and error"
# SQNR floors (dB) for a standard normal input, per element format
FLOOR_DB = {"e4m3": 28.0, "e5m2": 22.0, "e4m3fnuz": 28.0, "e5m2fnuz": 22.0, "e3m2": 22.0, "e2m3": 27.0, "e2m1": 14.0}


def run(ctx: Context) -> Outcome:
    rows, cols = ctx.pick({"tiny": (64, 256), "default": (1024, 4096), "full": (8192, 8192)})
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    out = Outcome(tensor_bytes=x.nbytes)
    cases, qs = {}, {}
    for name, scheme in SCHEMES.items():
        if scheme.rounding != "nearest":
            continue
        qs[name] = q = quantize(x, scheme)
        cases[f"quantize {name}"] = lambda s=scheme: phased("quantize", quantize, x, s)
        cases[f"dequantize {name}"] = lambda q=q: phased("dequantize", dequantize, q, torch.float32)
        out.tensor_bytes += q.nbytes
    med = ctx.time(cases)
    gb = x.nbytes / 1e9
    for name, q in qs.items():
        db = sqnr_db(x.cpu(), dequantize(q, torch.float32).cpu())
        floor = FLOOR_DB[q.scheme.element]
        out.rows.append({"scheme": name, "bits_per_element": q.bits_per_element, "sqnr_db": db, "floor_db": floor,
                         "quantize_s": med[f"quantize {name}"], "quantize_gbps": gb / med[f"quantize {name}"],
                         "dequantize_s": med[f"dequantize {name}"], "dequantize_gbps": gb / med[f"dequantize {name}"]})  # fmt: skip
        out.checks.append(Check(f"{name}: SQNR (dB) of a normal input", db, floor, ">="))
    out.trace = {n: (lambda s=SCHEMES[n]: dequantize(phased("quantize", quantize, x, s), torch.float32)) for n in qs}
    return out
