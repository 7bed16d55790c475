"""Side-by-side timings (`minifloat bench`). Numbers here are ratios measured in one run:
every case is timed in interleaved repetitions and reported as the median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from minifloat.quantize import dequantize, quantize
from minifloat.schemes import SCHEMES

DEFAULT_SCHEMES = tuple(SCHEMES)


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torchao_quantizers(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """torchao's CPU quantizers for the schemes it has (empty when torchao is absent)."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return {}
    return {
        "mxfp8": lambda: to_mx(x, torch.float8_e4m3fn, 32),
        "mxfp4": lambda: to_mx(x, torch.float4_e2m1fn_x2, 32),
        "nvfp4": lambda: nvfp4_quantize(x, 16),
    }


def bench_quantize(rows: int = 4096, cols: int = 8192, schemes=DEFAULT_SCHEMES, reps: int = 5) -> dict:
    """Quantize / dequantize throughput of every scheme vs a plain sum (the read bound) and
    vs torchao, interleaved over `reps` repetitions; medians."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    n = x.numel()
    peers = torchao_quantizers(x)
    cases: dict[str, Callable[[], object]] = {"read_bound": lambda: x.sum()}
    qs = {}
    for name in schemes:
        qs[name] = quantize(x, name)
        cases[f"q:{name}"] = lambda name=name: quantize(x, name)
        cases[f"dq:{name}"] = lambda name=name: dequantize(qs[name])
        if name in peers:
            cases[f"torchao:{name}"] = peers[name]
    for fn in cases.values():  # warm up (first-touch, lazy init)
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for key, fn in cases.items():
            times[key].append(_time(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    read = med["read_bound"]
    rows_out = []
    for name in schemes:
        tq, td = med[f"q:{name}"], med[f"dq:{name}"]
        ta = med.get(f"torchao:{name}")
        rows_out.append({
            "scheme": name,
            "quantize_gelem_s": n / tq / 1e9,
            "quantize_vs_read": read / tq,
            "dequantize_gelem_s": n / td / 1e9,
            "dequantize_vs_read": read / td,
            "torchao_gelem_s": None if ta is None else n / ta / 1e9,
            "speedup_vs_torchao": None if ta is None else ta / tq,
        })
    return {
        "shape": [rows, cols],
        "threads": torch.get_num_threads(),
        "read_bound_gelem_s": n / read / 1e9,
        "torchao": bool(peers),
        "reps": reps,
        "results": rows_out,
    }
