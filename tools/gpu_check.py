"""`make gpu-check`: everything minifloat runs on CUDA, in one go, into one report.

No native path of minifloat had run on a GPU before this existed: run it whenever a GPU machine
is at hand. Each step runs as its own process with a time limit, so one that fails or hangs
does not hide the others; the report (OUT/report.md, default runs/gpu-check) lists every step
with its command, exit status, seconds and the tail of its output, and the full logs lie beside it.

Steps, most telling first: the CUDA tests (pytest -m cuda), `minifloat info`, `minifloat bench
gemm` on CUDA, a short `minifloat train` (on the CPU: training has no device option yet) and
`minifloat bench decode` of that model on CUDA, then `minifloat validate --profile-all` at full size
on CUDA. `--budget SECONDS` shares a time limit among them (a lent GPU is often lent for minutes):
each step gets what is left, and the report is rewritten after every step, so a run cut short
still says what it reached.

On a machine whose Python already has a CUDA torch (no network): ``pip install --no-deps
--no-build-isolation -e .`` then ``python tools/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path


def steps(out: Path) -> list[tuple[str, list[str], int]]:
    py = sys.executable
    mf = [py, "-m", "minifloat"]
    model = out / "model"
    return [
        ("CUDA tests", [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", "tests"], 1800),
        ("info", [*mf, "info"], 120),
        ("bench gemm", [*mf, "bench", "gemm", "--device", "cuda"], 900),
        ("train (small, 60 steps)", [*mf, "train", "--model", "small", "--steps", "60", "--out", str(model), "--overwrite"], 900),
        ("bench decode", [*mf, "bench", "decode", str(model), "--device", "cuda", "--gemv", "", "--kv-formats", "bf16,fp8,nvfp4",
                          "--drafts", "nvfp4", "--draft-tokens", "4", "--new-tokens", "32", "--windows", "2"], 1800),
        ("validate --profile-all (full size)", [*mf, "validate", "--profile-all", "--device", "cuda", "--size", "full",
                                                 "--out", str(out / "validate")], 1800),
    ]  # fmt: skip


def slug(name: str) -> str:
    """A step's log file name: letters, digits and '-' only."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu-check", help="report folder (default runs/gpu-check)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all steps together (default: each its own limit)")
    args = ap.parse_args(argv)
    end = None if args.budget is None else time.monotonic() + args.budget
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: this torch sees no CUDA device; run it on a machine with an NVIDIA GPU and a CUDA torch", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    lines = [f"# minifloat gpu-check\n\ndevice: {torch.cuda.get_device_name(0)} (capability "
             f"{'.'.join(map(str, torch.cuda.get_device_capability(0)))}), torch {torch.__version__}, CUDA {torch.version.cuda}\n",
             "| step | exit | seconds |", "|---|---|---|"]  # fmt: skip
    details, failed = [], 0
    for name, cmd, limit in steps(out):
        log = out / (slug(name) + ".log")
        if end is not None:
            limit = min(limit, int(end - time.monotonic()))
            if limit < 5:
                lines.append(f"| {name} | not run: the budget was spent | 0 |")
                failed += 1
                continue
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            rc, text = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}\n(killed after {limit} s)"
        secs = time.perf_counter() - t0
        log.write_text(text if isinstance(text, str) else text.decode(errors="replace"))
        failed += rc != 0
        lines.append(f"| {name} | {rc} | {secs:.0f} |")
        tail = "\n".join(str(text).splitlines()[-40:])
        details.append(f"\n## {name}\n\n`{' '.join(cmd)}`\n\n```\n{tail}\n```\n")
        print(f"gpu-check: {name}: exit {rc}, {secs:.0f} s", flush=True)
        (out / "report.md").write_text("\n".join(lines) + "\n" + "".join(details))
    (out / "report.md").write_text("\n".join(lines) + "\n" + "".join(details))
    print(f"gpu-check: report in {out / 'report.md'}; {failed} step(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
