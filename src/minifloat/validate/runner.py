"""`minifloat validate`: examples that check, time and profile minifloat, run into one report.

An example is a module of `minifloat.validate.examples` with ``NAME``, ``TITLE`` and
``run(ctx) -> Outcome``. It measures with `Context.time` (interleaved repetitions, medians: the
ratios within one example are measured side by side) and states its correctness as `Check`s: a
measured figure against a threshold from an independent oracle (a float64 reference, the
published formula, an exact identity). Each callable it hands back in ``Outcome.trace`` runs once
under ``torch.profiler`` when profiling, inside ``record_function`` ranges named by `phase`
(``quantize``, ``gemm``, ``dequantize`` …) — and NVTX ranges on CUDA with ``nvtx=True``, for nsys.

The runner adds the example's wall time and memory: on CUDA the allocated, reserved and peak
bytes (``torch.cuda``), on a CPU the process' peak RSS and how much it grew during the example,
beside the tensor bytes the example reports.
"""

from __future__ import annotations

import contextlib
import importlib
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.measure.bench import interleaved_medians

EXAMPLES = ("formats", "quantize", "gemm", "fp4_inference", "transformer_layer", "compile", "training", "serving")
SIZES = ("tiny", "default", "full")


@dataclass
class Check:
    name: str
    measured: float
    threshold: float
    op: str = "<="  # measured op threshold passes
    detail: str = ""

    @property
    def passed(self) -> bool:
        m, t = self.measured, self.threshold
        return bool({"<=": m <= t, ">=": m >= t, "==": m == t}[self.op])

    def to_dict(self) -> dict:
        return {**vars(self), "passed": self.passed}


@dataclass
class Outcome:
    rows: list[dict] = field(default_factory=list)  # the example's table: one dict per case
    checks: list[Check] = field(default_factory=list)
    tensor_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    trace: dict[str, Callable[[], object]] = field(default_factory=dict)  # what the profiler runs


@dataclass(frozen=True)
class Context:
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - an immutable value
    size: str = "default"  # tiny (the test suite) | default (a CPU in minutes) | full (the documents' sizes, a GPU)
    reps: int = 5
    nvtx: bool = False

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, cases: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Median seconds per case over `reps` interleaved rounds (after one warm-up each)."""
        timed = {k: (lambda fn=fn: (fn(), self.sync())) for k, fn in cases.items()}
        return interleaved_medians(timed, self.reps)

    def pick(self, sizes: dict[str, object]):
        """The entry of `sizes` for this run's size."""
        return sizes[self.size]


@contextlib.contextmanager
def phase(name: str, nvtx: bool = False) -> Iterator[None]:
    """A named range for the profiler (and for nsys, with `nvtx` on CUDA)."""
    pushed = nvtx and torch.cuda.is_available()
    if pushed:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if pushed:
            torch.cuda.nvtx.range_pop()


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64."""
    ref = ref.detach().double()
    return float((x.detach().double() - ref).norm() / ref.norm())


def phased(name: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` inside `phase(name)`."""
    with phase(name):
        return fn(*args, **kwargs)


def load(name: str):
    if name not in EXAMPLES:
        raise MinifloatError(f"unknown example {name!r}; `minifloat validate --list` shows: {', '.join(EXAMPLES)}")
    return importlib.import_module(f"minifloat.validate.examples.{name}")


def _peak_rss() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024


def run_example(name: str, ctx: Context, *, trace_dir: Path | None = None) -> dict:
    """Run one example; return its metrics (rows, checks, time, memory, trace file)."""
    module = load(name)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    rss0 = _peak_rss()
    t0 = time.perf_counter()
    error = None
    try:
        out: Outcome = module.run(ctx)
    except Exception as err:  # noqa: BLE001 - an example that raises is a failed example, not a crashed run
        out = Outcome()
        error = f"{type(err).__name__}: {err}"
        out.notes.append("".join(traceback.format_exception(err))[-2000:])
    wall = time.perf_counter() - t0
    memory = {"tensor_bytes": out.tensor_bytes}
    if cuda:
        memory |= {"cuda_allocated": torch.cuda.memory_allocated(ctx.device), "cuda_reserved": torch.cuda.memory_reserved(ctx.device),
                   "cuda_peak": torch.cuda.max_memory_allocated(ctx.device)}  # fmt: skip
    else:
        memory |= {"peak_rss": _peak_rss(), "peak_rss_growth": _peak_rss() - rss0}
    trace = None
    if trace_dir is not None and out.trace and error is None:
        trace = _profile(name, out.trace, ctx, trace_dir)
    checks = [c.to_dict() for c in out.checks]
    if error:
        checks.append(Check("ran without an exception", 1.0, 0.0, "<=", error).to_dict())
    return {"name": name, "title": module.TITLE, "rows": out.rows, "checks": checks,
            "passed": all(c["passed"] for c in checks), "wall_s": wall, "memory": memory, "notes": out.notes,
            "trace": trace, "error": error}  # fmt: skip


def _profile(name: str, cases: dict[str, Callable[[], object]], ctx: Context, trace_dir: Path) -> str:
    from torch.profiler import ProfilerActivity, profile

    from minifloat.io.atomic import atomic_path

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    trace_dir.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, profile_memory=True) as prof:
        for case, fn in cases.items():
            with phase(f"{name}/{case}", ctx.nvtx):
                fn()
            ctx.sync()
    path = trace_dir / f"{name}.json"
    with atomic_path(path) as tmp:
        prof.export_chrome_trace(str(tmp))
    return str(path)


def run_examples(names, ctx: Context, *, trace_dir: Path | None = None, progress: bool = True) -> list[dict]:
    """Every example of `names` in turn, with a progress bar."""
    from tqdm import tqdm

    results = []
    bar = tqdm(names, desc="validate", unit="example", disable=not progress, file=sys.stderr)
    for name in bar:
        bar.set_postfix_str(name)
        results.append(run_example(name, ctx, trace_dir=trace_dir))
    return results


def validate(names, out: str | Path, ctx: Context, *, profile: bool = False, plots: bool = True, progress: bool = True) -> dict:
    """Run `names`, write ``metrics.json``, ``report.md``, ``plots/`` and (with `profile`)
    ``profiler_output/<example>.json`` under `out`; return the metrics."""
    from minifloat.gemm.support import native_bf16_cpu
    from minifloat.io import jsonio
    from minifloat.io.atomic import atomic_path
    from minifloat.measure.compare import environment
    from minifloat.report.validate import write_validate_report

    if ctx.size not in SIZES:
        raise MinifloatError(f"size {ctx.size!r}: use one of {', '.join(SIZES)}")
    for n in names:
        load(n)  # an unknown name fails before anything runs
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    examples = run_examples(names, ctx, trace_dir=out / "profiler_output" if profile else None, progress=progress)
    env = environment() | {"bf16_native": ctx.device.type == "cuda" or native_bf16_cpu()}
    metrics = {"size": ctx.size, "device": str(ctx.device), "reps": ctx.reps, "wall_s": time.perf_counter() - t0,
               "passed": all(e["passed"] for e in examples), "examples": examples, "env": env}  # fmt: skip
    with atomic_path(out / "metrics.json") as tmp:
        tmp.write_text(jsonio.dumps(metrics, indent=2))
    write_validate_report(metrics, out, plots=plots)
    return metrics
