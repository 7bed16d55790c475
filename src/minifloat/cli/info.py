"""`minifloat info`: the device, its capability, and which recipes run native vs emulated."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="hardware support: which recipes run native GEMMs here")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from minifloat.measure.devices import describe

    out = describe()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"minifloat {out['minifloat']}  torch {out['torch']}")
    for dev in out["devices"]:
        print(f"\n{dev['device']}: {dev['name']}  ({dev['detail']})")
        print(f"  fast quantize kernels: {dev['fast_kernels']}")
        if "decode_kernels" in dev:
            print(f"  decode kernels (weight-only GEMVs, ≤ 16 rows): {dev['decode_kernels']}")
            print(f"  FP8 GEMMs (per tensor / per row): {dev['fp8_gemm']}")
        for r in dev["recipes"]:
            note = f"  ({r['why']})" if r["why"] else ""
            print(f"  {r['recipe']:12} {r['backend']:9}{note}")
    return 0
