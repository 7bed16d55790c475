"""Side-by-side timings (`minifloat bench quantize|gemm|train`). Numbers here are ratios
measured in one run: every case is timed in interleaved repetitions and reported as the median."""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

from minifloat import gemm
from minifloat.kernels.allocator import keeps_freed_memory
from minifloat.nn.convert import convert
from minifloat.quant.api import dequantize, quantize
from minifloat.scaling.schemes import SCHEMES, get_scheme

DEFAULT_SCHEMES = tuple(SCHEMES)


class Elapsed(float):
    """Seconds that a case measured itself (in another process): used instead of the wall time
    of the call, which would add the round trip."""


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    return float(out) if isinstance(out, Elapsed) else wall


def interleaved_times(cases: dict[str, Callable[[], object]], reps: int, progress=None) -> dict[str, list[float]]:
    """Seconds of each case in each of `reps` rounds: one warm-up call each first (first touch,
    lazy init), then rounds that run every case once, so drift in the machine hits all cases
    alike and round i of two cases ran moments apart."""
    for key, fn in cases.items():
        if progress:
            progress(f"warm-up {key}")
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(reps):
        for key, fn in cases.items():
            if progress:
                progress(f"rep {i + 1}/{reps} {key}")
            times[key].append(_time(fn))
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """The median of each case's rounds."""
    return {k: statistics.median(v) for k, v in times.items()}


def interleaved_medians(cases: dict[str, Callable[[], object]], reps: int, progress=None) -> dict[str, float]:
    """Median seconds of each case over `interleaved_times`' rounds."""
    return medians(interleaved_times(cases, reps, progress))


def quartiles(values: list[float]) -> list[float]:
    """[lower quartile, upper quartile] of `values` (the value twice when there is one).

    >>> quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
    [2.0, 4.0]
    """
    if len(values) == 1:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]


@contextlib.contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """Importing torchao logs a warning per CUDA-only extension it cannot load on this machine,
    and torch's pytree one per Enum it registers: noise in a benchmark table, so held back."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def torchao_quantizers(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """torchao's CPU quantizers for the schemes it has (empty when torchao is absent), each
    doing the same scheme's work: NVFP4 with its FP32 tensor scale from the tensor amax (the
    two-level scaling minifloat's `nvfp4` does), not torchao's default of block scales only."""
    try:
        with _quiet_torchao_import():
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return {}
    return {
        "mxfp8": lambda: to_mx(x, torch.float8_e4m3fn, 32),
        "mxfp4": lambda: to_mx(x, torch.float4_e2m1fn_x2, 32),
        "nvfp4": lambda: nvfp4_quantize(x, 16, per_tensor_amax_to_scale(torch.amax(torch.abs(x)))),
    }


def _bench_input(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))


def wake(seconds: float = 0.01, kernels: bool = True) -> None:
    """Keep the thread pools busy with tiny parallel calls for `seconds`. A process that has
    waited (here, while the other process of `StockTorchao` ran) finds its threads asleep and,
    in a VM, its virtual CPUs descheduled, and the first call after a pause pays for waking them
    (milliseconds). Interleaved rounds run every other case back to back, as a training
    loop would, so a case timed after such a pause is woken first. `kernels`: also minifloat's
    kernels, whose OpenMP pool is not torch's."""
    small = torch.ones(2, 1 << 16)  # above torch's grain size (32768 elements): a parallel sum
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        small.sum()
        if kernels:
            quantize(small, "fp8")


def stock_worker() -> None:
    """The loop of `StockTorchao`'s process: quantize the bench input with the torchao scheme named
    on each stdin line and print the seconds it took, having woken its threads as the other
    process's cases find theirs (`wake`)."""
    rows, cols, threads = map(int, sys.argv[1:4])
    torch.set_num_threads(threads)
    peers = torchao_quantizers(_bench_input(rows, cols))
    print("ready" if peers else "unavailable", flush=True)
    for line in sys.stdin:
        wake(kernels=False)
        print(_time(peers[line.strip()]), flush=True)


class StockTorchao:
    """torchao's quantizers as a plain script runs them: in a separate process with torch's
    defaults (no transparent huge pages, glibc's malloc untouched), where minifloat's own process
    lends them its settings. The cases it returns time one call there each (`Elapsed`), so they
    interleave with the in-process ones. Use as a context manager; `available` is False when
    torchao does not import there."""

    # After a parallel region, libgomp's threads spin for a while (GOMP_SPINCOUNT, milliseconds
    # here) before they sleep: the case timed next would share the cores with the worker's. A
    # case right after a stock call measured 0.24 of the read bound instead of 0.33-0.37.
    settle_s = 0.1

    def __init__(self, rows: int, cols: int):
        self._err = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE="0")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from minifloat.measure.bench import stock_worker; stock_worker()",
             str(rows), str(cols), str(torch.get_num_threads())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env,
        )  # fmt: skip
        self.available = self._proc.stdout.readline().strip() == "ready"

    def case(self, name: str) -> Callable[[], Elapsed]:
        def run() -> Elapsed:
            self._proc.stdin.write(name + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if not line:
                self._err.seek(0)
                raise RuntimeError(f"the stock torchao process ended: {self._err.read()[-2000:]}")
            time.sleep(self.settle_s)
            wake()  # the case timed next finds this process's threads awake
            return Elapsed(line)

        return run

    def __enter__(self) -> StockTorchao:
        return self

    def __exit__(self, *exc) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._err.close()


def bench_quantize(rows: int = 4096, cols: int = 8192, schemes=DEFAULT_SCHEMES, reps: int = 9) -> dict:
    """Quantize / dequantize throughput of every scheme vs a plain sum (the read bound) and
    vs torchao, both in this process and in a stock one (`StockTorchao`), interleaved over
    `reps` repetitions; medians. The ratios to the read bound are taken round by round, where
    the sum and the case ran moments apart (a shift in the machine's memory bandwidth between
    rounds moves both), then their median and quartiles (``*_vs_read_iqr``); the read bound's
    slowest and fastest round show how steady the machine was. For context, PyTorch's own
    unscaled cast to float8_e4m3fn (``torch_cast``: one read, one 1-byte write, no amax) is
    timed in the same run."""
    x = _bench_input(rows, cols)
    peers = torchao_quantizers(x)
    if not peers or not any(name in peers for name in schemes):
        return _bench_quantize(x, schemes, reps, peers, None)
    with StockTorchao(rows, cols) as stock:
        return _bench_quantize(x, schemes, reps, peers, stock if stock.available else None)


def _bench_quantize(x: torch.Tensor, schemes, reps: int, peers: dict, stock: StockTorchao | None) -> dict:
    n = x.numel()
    cases: dict[str, Callable[[], object]] = {"read_bound": lambda: x.sum()}
    cast = getattr(torch, "float8_e4m3fn", None)
    if cast is not None:  # context: PyTorch's own fp32 -> fp8 cast, no amax and no scale
        cases["torch_cast"] = lambda: x.to(cast)
    qs = {}
    for name in schemes:
        qs[name] = quantize(x, name)
        cases[f"q:{name}"] = lambda name=name: quantize(x, name)
        cases[f"dq:{name}"] = lambda name=name: dequantize(qs[name])
        if name in peers:
            cases[f"torchao:{name}"] = peers[name]
            if stock is not None:
                cases[f"stock:{name}"] = stock.case(name)
    times = interleaved_times(cases, reps)
    med = medians(times)
    read = med["read_bound"]
    tc = med.get("torch_cast")

    def vs_read(key: str) -> list[float]:  # the ratio to the read bound within each round
        return [r / t for r, t in zip(times["read_bound"], times[key], strict=True)]

    rows_out = []
    for name in schemes:
        tq, td = med[f"q:{name}"], med[f"dq:{name}"]
        ta, ts = med.get(f"torchao:{name}"), med.get(f"stock:{name}")
        rows_out.append({
            "scheme": name,
            "quantize_gelem_s": n / tq / 1e9,
            "quantize_vs_read": statistics.median(vs_read(f"q:{name}")),
            "quantize_vs_read_iqr": quartiles(vs_read(f"q:{name}")),
            "dequantize_gelem_s": n / td / 1e9,
            "dequantize_vs_read": statistics.median(vs_read(f"dq:{name}")),
            "dequantize_vs_read_iqr": quartiles(vs_read(f"dq:{name}")),
            "torchao_gelem_s": None if ta is None else n / ta / 1e9,
            "speedup_vs_torchao": None if ta is None else ta / tq,
            "torchao_stock_gelem_s": None if ts is None else n / ts / 1e9,
            "speedup_vs_torchao_stock": None if ts is None else ts / tq,
        })
    return {
        "shape": list(x.shape),
        "threads": torch.get_num_threads(),
        "read_bound_gelem_s": n / read / 1e9,
        "read_bound_gelem_s_range": [n / max(times["read_bound"]) / 1e9, n / min(times["read_bound"]) / 1e9],
        "torch_cast_gelem_s": None if tc is None else n / tc / 1e9,
        "torch_cast_vs_read": None if tc is None else statistics.median(vs_read("torch_cast")),
        "torchao": bool(peers),
        "torchao_stock": stock is not None,
        "keeps_freed_memory": keeps_freed_memory(),
        "reps": reps,
        "results": rows_out,
    }


GEMM_DEFAULT_SCHEMES = ("fp8", "fp8_rowwise", "fp8_block128", "mxfp8", "mxfp4", "nvfp4")
# The weight operand's scheme where it differs from the activation's (DeepSeek-V3's 128×128 weights).
_GEMM_WEIGHT = {"fp8_block128": "fp8_block128x128"}


def bench_gemm(m: int, n: int, k: int, schemes=GEMM_DEFAULT_SCHEMES, *, device: str | torch.device = "cpu",
               reps: int = 9, bf16: bool = True) -> dict:
    """``a · bᵀ`` ((m,k) activations, (n,k) weights, quantized once beforehand) per scheme:
    the emulated GEMM and, where the device has it, the native one, against FP32 and BF16
    matmuls on the same operands, interleaved over `reps` rounds; medians. For native GEMMs
    also their agreement with emulated: ‖native − emulated‖ / ‖emulated‖."""

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    a, b = torch.randn(m, k, device=dev, generator=g), torch.randn(n, k, device=dev, generator=g)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: (fn(), sync())

    cases: dict[str, Callable[[], object]] = {"fp32": timed(lambda: a @ b.T)}
    if bf16:
        ab, bb = a.bfloat16(), b.bfloat16()
        cases["bf16"] = timed(lambda: ab @ bb.T)
    info = {}
    for name in schemes:
        sa, sb = get_scheme(name), get_scheme(_GEMM_WEIGHT.get(name, name))
        qa, qb = quantize(a, sa), quantize(b, sb)
        cases[f"emulated:{name}"] = timed(lambda qa=qa, qb=qb: gemm.scaled_mm(qa, qb, backend="emulated"))
        why = gemm.native_support(sa, dev) or gemm.native_support(sb, dev)
        err = None
        if why is None:
            cases[f"native:{name}"] = timed(lambda qa=qa, qb=qb: gemm.scaled_mm(qa, qb, backend="native"))
            ref = gemm.scaled_mm(qa, qb, backend="emulated").double()
            err = ((gemm.scaled_mm(qa, qb, backend="native").double() - ref).norm() / ref.norm()).item()
        info[name] = (sb.name, why, err)
    med = interleaved_medians(cases, reps)
    tflops = lambda t: 2 * m * n * k / t / 1e12  # noqa: E731
    rows = []
    for name in schemes:
        weight, why, err = info[name]
        te, tn = med[f"emulated:{name}"], med.get(f"native:{name}")
        rows.append({
            "scheme": name,
            "weight_scheme": weight,
            "emulated_tflops": tflops(te),
            "emulated_vs_bf16": te / med["bf16"] if bf16 else None,
            "native_tflops": None if tn is None else tflops(tn),
            "native_vs_bf16": None if tn is None or not bf16 else tn / med["bf16"],
            "native_rel_error": err,
            "native_unavailable": why,
        })
    return {
        "shape": [m, n, k],
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "reps": reps,
        "fp32_tflops": tflops(med["fp32"]),
        "bf16_tflops": tflops(med["bf16"]) if bf16 else None,
        "bf16_native": bf16_native(dev),
        "results": rows,
    }


def bf16_native(device: torch.device) -> bool:
    """Whether `device` multiplies BF16 in hardware (BF16 units on a CPU; every CUDA GPU
    minifloat supports), so that a BF16 baseline measured on it is the real one."""
    return device.type == "cuda" or gemm.native_bf16_cpu()


TRAIN_DEFAULT_RECIPES = ("fp8", "fp8-current", "mxfp8", "nvfp4")

# A BF16 matmul this many times slower than FP32 has no BF16 units under it (CPUs without
# AVX512-BF16 / AMX convert element by element, orders of magnitude slower); native ones are
# within a small factor of FP32.
BF16_EMULATED_SLOWDOWN = 8.0


def bf16_matmul_slowdown(n: int = 256, device: str | torch.device = "cpu") -> float:
    """Time of an n³ BF16 matmul over the FP32 one on `device` (best of 3 each): a probe of
    whether BF16 is native there, taken before minutes of BF16 baseline are spent.

    Example:
        >>> bf16_matmul_slowdown(32) > 0
        True
    """
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device).to(dtype)
        (a @ a).sum().item()  # warm-up, and a sync on an asynchronous device
        best[dtype] = min(_time(lambda a=a: (a @ a).sum().item()) for _ in range(3))
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def train_baselines(bf16: bool | None, *, slowdown: Callable[[], float] | None = None
                    ) -> tuple[tuple[str, ...], str | None]:
    """`bench_train`'s baselines: FP32 and torchao, and BF16 autocast when `bf16` is True, or
    (None) when `slowdown()` (default `bf16_matmul_slowdown`) shows BF16 matmuls native.
    Returns the baselines and, when BF16 was left out for being emulated, a note saying so."""
    if bf16 is False:
        return ("fp32", "torchao"), None
    if bf16 is None:
        ratio = (slowdown or bf16_matmul_slowdown)()
        if ratio > BF16_EMULATED_SLOWDOWN:
            return ("fp32", "torchao"), (
                f"BF16 baseline skipped: a BF16 matmul takes {ratio:.0f}x the FP32 time on this machine "
                "(no BF16 units: at the default size a BF16 step takes minutes); --bf16 times it anyway")
    return ("bf16", "fp32", "torchao"), None


def _mlp(layers: int, dim: int, hidden: int) -> torch.nn.Sequential:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim)]
    return torch.nn.Sequential(*blocks)


def _torchao_float8(model: torch.nn.Module):
    """torchao's float8 training in emulation (its CPU path), or None when unavailable."""
    try:
        with _quiet_torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))


def bench_train(
    recipes=TRAIN_DEFAULT_RECIPES,
    *,
    layers: int = 4,
    dim: int = 1024,
    hidden: int = 4096,
    tokens: int = 2048,
    reps: int = 3,
    baselines: tuple[str, ...] = ("bf16", "fp32", "torchao"),
    progress=None,
) -> dict:
    """Training-step time (forward, backward, SGD step) of a `layers` × (dim→hidden→dim) MLP
    on `tokens` tokens: each recipe vs BF16 autocast and FP32 on the same model, and torchao's
    float8 training (``emulate=True``), interleaved over `reps` rounds; medians."""
    import contextlib
    import copy


    torch.manual_seed(0)
    base = _mlp(layers, dim, hidden)
    x = torch.randn(tokens, dim)
    models: dict[str, tuple[torch.nn.Module, Callable]] = {}
    if "bf16" in baselines:
        models["bf16"] = (copy.deepcopy(base), lambda: torch.autocast(x.device.type, dtype=torch.bfloat16))
    if "fp32" in baselines:
        models["fp32"] = (copy.deepcopy(base), contextlib.nullcontext)
    if "torchao" in baselines:
        ao = _torchao_float8(copy.deepcopy(base))
        if ao is not None:
            models["torchao-float8"] = (ao, contextlib.nullcontext)
    for name in recipes:
        models[name] = (convert(copy.deepcopy(base), name), contextlib.nullcontext)

    def step(model, ctx, opt):
        with ctx():
            y = model(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    cases = {}
    for name, (model, ctx) in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        cases[name] = lambda model=model, ctx=ctx, opt=opt: step(model, ctx, opt)
    med = interleaved_medians(cases, reps, progress)
    rows = []
    for name, t in med.items():
        rows.append({
            "model": name,
            "step_s": t,
            "vs_bf16": t / med["bf16"] if "bf16" in med else None,
            "vs_fp32": t / med["fp32"] if "fp32" in med else None,
            "tokens_per_s": tokens / t,
        })
    return {
        "mlp": {"layers": layers, "dim": dim, "hidden": hidden, "tokens": tokens},
        "threads": torch.get_num_threads(),
        "reps": reps,
        "results": rows,
    }
