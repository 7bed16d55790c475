"""`minifloat error`: quantization error of every scheme on synthetic or saved tensors."""

from __future__ import annotations

import argparse

from minifloat.errors import MinifloatError
from minifloat.io import jsonio


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("error", help="quantization error (SQNR, saturation, underflow) per scheme")
    p.add_argument("--input", default="gaussian",
                   help="gaussian | heavy | outliers | FILE.safetensors[:TENSOR]")
    p.add_argument("--size", default="1024x1024", help="ROWSxCOLS of a synthetic input")
    p.add_argument("--schemes", default=None, help="comma-separated schemes (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of a synthetic input")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(run=run)


def _load_input(spec: str, size: str, seed: int):
    import torch

    from minifloat.measure.error_analysis import synthetic

    if spec.split(":")[0].endswith(".safetensors"):
        from safetensors import safe_open

        path, _, name = spec.partition(":")
        try:
            with safe_open(path, framework="pt") as f:
                if (f.metadata() or {}).get("format", "").startswith("minifloat/"):
                    return _minifloat_entry(path, name)
                keys = list(f.keys())
                if not name:  # the first floating-point tensor
                    name = next((k for k in keys if f.get_slice(k).get_dtype().startswith(("F", "BF"))), "")
                    if not name:
                        raise MinifloatError(f"{path} holds no floating-point tensor; it has: {', '.join(keys[:10])}")
                key = name
                if key not in keys and f"{key}.tensor" in keys:  # a plain tensor minifloat.save wrote
                    key = f"{key}.tensor"
                if key not in keys:
                    raise MinifloatError(f"{path} has no tensor {key!r}; it has: {', '.join(keys[:10])}")
                x = f.get_tensor(key)
        except MinifloatError:
            raise
        except Exception as err:  # OSError, or safetensors' own error for a damaged file
            raise MinifloatError(f"cannot read {path}: {err}") from None
        if not x.is_floating_point():
            raise MinifloatError(f"tensor {key!r} in {path} is {x.dtype}, not floating point")
        return f"{path}:{key}", x.float() if x.dtype == torch.float64 else x
    try:
        rows, cols = (int(v) for v in size.lower().split("x"))
        if rows < 1 or cols < 1:
            raise ValueError
    except ValueError:
        raise MinifloatError(f"--size must be two positive numbers like 1024x1024, got {size!r}") from None
    return spec, synthetic(spec, rows, cols, seed)


def _minifloat_entry(path: str, name: str):
    """Entry `name` (or the first floating-point one) of a file minifloat.save wrote, verified
    by minifloat.load; a QuantizedTensor as its dequantized values (its parts, such as the
    scale grid, are not tensors of the user's)."""
    import torch

    import minifloat

    entries = minifloat.load(path)
    if not name:
        name = next((k for k, v in entries.items() if v.dtype.is_floating_point), "")
        if not name:
            raise MinifloatError(f"{path} holds no floating-point tensor; it has: {', '.join(list(entries)[:10])}")
    if name not in entries:
        raise MinifloatError(f"{path} has no tensor {name!r}; it has: {', '.join(list(entries)[:10])}")
    x = entries[name]
    if isinstance(x, minifloat.QuantizedTensor):
        return f"{path}:{name} (dequantized {x.scheme.name})", x.dequantize(x.orig_dtype)
    if not x.is_floating_point():
        raise MinifloatError(f"tensor {name!r} in {path} is {x.dtype}, not floating point")
    return f"{path}:{name}", x.float() if x.dtype == torch.float64 else x


def run(args: argparse.Namespace) -> int:
    import torch

    from minifloat.measure.error_analysis import error_report
    from minifloat.scaling.schemes import SCHEMES, get_scheme

    label, x = _load_input(args.input, args.size, args.seed)
    names = list(SCHEMES) if not args.schemes else [get_scheme(s).name for s in args.schemes.split(",")]
    rows = [error_report(x, n) for n in names]
    if args.json:
        print(jsonio.dumps({"input": label, "shape": list(x.shape), "results": rows}, indent=2))
        return 0
    print(f"input {label} {tuple(x.shape)}")
    bad = {kind: int(f(x).sum()) for kind, f in (("NaN", torch.isnan), ("inf", torch.isinf))}
    if any(bad.values()):
        print(f"note: the input holds {bad['NaN']} NaN and {bad['inf']} inf; the figures are over its finite "
              f"elements, less those a NaN makes NaN (its block's share: 'NaN' column)")
    nan_col = any(r["frac_nan"] for r in rows)
    print(f"{'scheme':18} {'SQNR dB':>8} {'rel L2':>9} {'max abs err':>11} {'bits/el':>7} {'vs FP16':>7} {'saturated':>9} {'underflow':>9}"
          + (f" {'NaN':>9}" if nan_col else ""))
    for r in rows:
        print(f"{r['scheme']:18} {r['sqnr_db']:8.2f} {r['rel_l2']:9.2e} {r['max_abs_err']:11.3e} "
              f"{r['bits_per_element']:7.3f} {r['memory_vs_fp16']:7.3f} {r['frac_saturated']:9.2e} {r['frac_underflow']:9.2e}"
              + (f" {r['frac_nan']:9.2e}" if nan_col else ""))
    return 0
