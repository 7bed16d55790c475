import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minifloat.cli import main
from minifloat.measure.bench import (
    Elapsed,
    StockTorchao,
    bench_quantize,
    interleaved_medians,
    interleaved_times,
    quartiles,
)


def test_interleaved_medians_take_a_case_s_own_elapsed_time():
    med = interleaved_medians({"remote": lambda: Elapsed(5.0), "local": lambda: None}, reps=3)
    assert med["remote"] == 5.0 and med["local"] < 1.0


def test_interleaved_times_run_every_case_once_per_round_after_one_warm_up_each():
    calls = []
    times = interleaved_times({k: (lambda k=k: calls.append(k)) for k in ("a", "b", "c")}, reps=2)
    assert calls == ["a", "b", "c"] * 3 and [len(v) for v in times.values()] == [2, 2, 2]


def test_quartiles_of_the_rounds():
    assert quartiles([3.0]) == [3.0, 3.0]
    assert quartiles([0.5, 0.25, 0.5]) == [0.375, 0.5]
    assert quartiles([4.0, 1.0, 3.0, 2.0]) == [1.75, 3.25]


def test_wake_keeps_both_thread_pools_busy_for_the_time_given(monkeypatch):
    import minifloat.measure.bench as bench

    calls = []
    monkeypatch.setattr(bench, "quantize", lambda x, scheme: calls.append((tuple(x.shape), scheme)))
    bench.wake(0.0)
    assert calls == []
    t0 = time.perf_counter()
    bench.wake(0.02)
    assert time.perf_counter() - t0 >= 0.02 and calls and set(calls) == {((2, 65536), "fp8")}
    calls.clear()
    bench.wake(0.02, kernels=False)  # the stock process times torchao: torch's pool only
    assert calls == []


def test_a_stock_case_wakes_this_process_before_the_next_case(monkeypatch):
    """The stock process ran while this one waited: the case after it finds the threads woken."""
    import io

    import minifloat.measure.bench as bench

    events = []
    monkeypatch.setattr(bench, "wake", lambda *a, **kw: events.append("wake"))
    monkeypatch.setattr(bench.time, "sleep", lambda s: events.append(("sleep", s)))
    stock = StockTorchao.__new__(StockTorchao)
    stock._proc = type("P", (), {"stdin": io.StringIO(), "stdout": io.StringIO("0.25\n")})()
    t = stock.case("mxfp8")()
    assert isinstance(t, Elapsed) and t == 0.25 and stock._proc.stdin.getvalue() == "mxfp8\n"
    assert events == [("sleep", StockTorchao.settle_s), "wake"]


def test_stock_torchao_runs_in_a_process_with_torch_defaults():
    """The stock column: torchao timed in a child process without minifloat's huge pages or
    allocator settings, with this process's thread count, on the same input (same seed)."""
    pytest.importorskip("torchao")
    with StockTorchao(64, 256) as stock:
        assert stock.available
        assert stock._proc.args[-1] == str(torch.get_num_threads())
        environ = Path(f"/proc/{stock._proc.pid}/environ")
        if environ.exists():
            assert b"THP_MEM_ALLOC_ENABLE=0" in environ.read_bytes().split(b"\0")
        times = [stock.case(name)() for name in ("mxfp8", "mxfp4", "nvfp4")]
    assert all(isinstance(t, Elapsed) and 0 < t < 60 for t in times)
    assert stock._proc.returncode == 0  # closed cleanly


def test_the_torchao_peers_quantize_the_same_schemes():
    """The speed-ups compare equal work: each torchao quantizer the benchmark times computes
    minifloat's scheme. MX (scale rule floor): the same values. NVFP4: two-level, as
    minifloat's, so the same E2M1 codes and E4M3 block scales (but for an all-zero block, whose
    scale torchao clamps to E4M3's smallest normal) and the same tensor scale up to its
    rounding (torchao divides amax by 6 * 448, NVIDIA's reference inverts 6 * 448 / amax)."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import to_dtype

    from minifloat import quantize, unpack
    from minifloat.measure.bench import _bench_input, torchao_quantizers

    x = _bench_input(64, 256) * 3
    x[3, :32] = 0
    peers = torchao_quantizers(x)
    assert sorted(peers) == ["mxfp4", "mxfp8", "nvfp4"]
    for name, elem in (("mxfp8", torch.float8_e4m3fn), ("mxfp4", torch.float4_e2m1fn_x2)):
        scale, data = peers[name]()
        assert torch.equal(to_dtype(data, scale, elem, 32, torch.float32), quantize(x, name).dequantize()), name
    scale, packed = peers["nvfp4"]()
    q = quantize(x, "nvfp4")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(64, 256)  # low nibble first
    assert torch.equal(codes, unpack(q.data.reshape(-1), "e2m1", x.numel()).reshape(64, 256))
    differ = (scale.view(torch.uint8) != q.scale).nonzero().tolist()
    assert differ == [[3, 0], [3, 1]] and q.scale[3, :2].tolist() == [0, 0]  # the zero blocks
    tensor_scale = x.abs().max() / (6 * 448)
    assert abs(float(q.tensor_scale) - float(tensor_scale)) <= torch.finfo(torch.float32).eps * float(tensor_scale)


def test_bench_quantize_reports_both_torchao_columns():
    pytest.importorskip("torchao")
    out = bench_quantize(64, 256, schemes=("mxfp8", "fp8"), reps=1)
    assert out["torchao"] and out["torchao_stock"]
    mx, fp8 = out["results"]
    assert mx["torchao_stock_gelem_s"] > 0 and mx["speedup_vs_torchao_stock"] > 0
    assert mx["speedup_vs_torchao"] > 0
    assert fp8["torchao_gelem_s"] is None and fp8["torchao_stock_gelem_s"] is None  # torchao has no such quantizer


def test_bench_quantize_figures_from_the_rounds(monkeypatch):
    """Every figure from the timed rounds: Gelem/s = n / median t, speed-ups = median t_torchao /
    median t_minifloat, ratios to the read bound = the median and quartiles of t_read / t taken
    round by round (not the ratio of the medians); each case runs what its name says."""
    import minifloat.measure.bench as bench
    from minifloat import dequantize, quantize

    x = torch.randn(64, 256)
    n = x.numel()
    seen = {}
    rounds = {"read_bound": [1.0, 2.0, 4.0], "torch_cast": [4.0, 4.0, 4.0], "q:mxfp8": [2.0, 8.0, 8.0],
              "dq:mxfp8": [5.0, 5.0, 5.0], "torchao:mxfp8": [40.0, 30.0, 50.0], "stock:mxfp8": [100.0] * 3,
              "q:fp8": [16.0, 16.0, 16.0], "dq:fp8": [10.0, 2.0, 20.0]}  # fmt: skip

    def fake_times(cases, reps):
        seen.update(cases, reps=reps)
        return {k: rounds[k] for k in cases}

    class Stock:
        def case(self, name):
            return lambda: f"stock {name}"

    monkeypatch.setattr(bench, "interleaved_times", fake_times)
    out = bench._bench_quantize(x, ("mxfp8", "fp8"), 3, {"mxfp8": lambda: "torchao mxfp8"}, Stock())
    assert sorted(k for k in seen if k != "reps") == sorted(rounds) and seen["reps"] == 3
    assert torch.equal(seen["read_bound"](), x.sum()) and seen["torch_cast"]().dtype == torch.float8_e4m3fn
    assert torch.equal(seen["q:fp8"]().dequantize(), quantize(x, "fp8").dequantize())
    assert torch.equal(seen["dq:mxfp8"](), dequantize(quantize(x, "mxfp8")))
    assert (seen["torchao:mxfp8"](), seen["stock:mxfp8"]()) == ("torchao mxfp8", "stock mxfp8")
    assert out["read_bound_gelem_s"] == n / 2.0 / 1e9
    assert out["read_bound_gelem_s_range"] == [n / 4.0 / 1e9, n / 1.0 / 1e9]  # slowest, fastest round
    assert (out["torch_cast_gelem_s"], out["torch_cast_vs_read"]) == (n / 4.0 / 1e9, 0.5)
    assert out["torchao"] and out["torchao_stock"] and out["shape"] == [64, 256] and out["reps"] == 3
    mx, fp8 = out["results"]
    assert mx.pop("dequantize_vs_read_iqr") == pytest.approx([0.3, 0.6])  # rounds: 0.2, 0.4, 0.8
    assert mx == {
        "scheme": "mxfp8", "quantize_gelem_s": n / 8.0 / 1e9,
        "quantize_vs_read": 0.5, "quantize_vs_read_iqr": [0.375, 0.5],  # rounds: 0.5, 0.25, 0.5
        "dequantize_gelem_s": n / 5.0 / 1e9, "dequantize_vs_read": 0.4,
        "torchao_gelem_s": n / 40.0 / 1e9, "speedup_vs_torchao": 5.0,
        "torchao_stock_gelem_s": n / 100.0 / 1e9, "speedup_vs_torchao_stock": 12.5,
    }  # fmt: skip
    assert (fp8["quantize_vs_read"], fp8["quantize_vs_read_iqr"]) == (0.125, [0.09375, 0.1875])
    assert (fp8["dequantize_gelem_s"], fp8["dequantize_vs_read"]) == (n / 10.0 / 1e9, 0.2)  # rounds: 0.1, 1, 0.2
    assert fp8["dequantize_vs_read_iqr"] == pytest.approx([0.15, 0.6])
    assert fp8["torchao_gelem_s"] is None and fp8["speedup_vs_torchao_stock"] is None


def test_bench_train_figures_from_the_medians(monkeypatch):
    """Step times are the medians as measured; the ratios and tokens/s come from them."""
    import minifloat.measure.bench as bench

    medians = {"bf16": 0.5, "fp32": 1.0, "fp8": 2.0, "mxfp8": 4.0}
    monkeypatch.setattr(bench, "interleaved_medians", lambda cases, reps, progress=None: {k: medians[k] for k in cases})
    out = bench.bench_train(("fp8", "mxfp8"), layers=1, dim=32, hidden=32, tokens=64, reps=1, baselines=("bf16", "fp32"))
    rows = {r["model"]: r for r in out["results"]}
    assert list(rows) == ["bf16", "fp32", "fp8", "mxfp8"]
    assert [rows[m]["step_s"] for m in rows] == [0.5, 1.0, 2.0, 4.0]
    assert [rows[m]["vs_bf16"] for m in rows] == [1.0, 2.0, 4.0, 8.0]
    assert [rows[m]["vs_fp32"] for m in rows] == [0.5, 1.0, 2.0, 4.0]
    assert [rows[m]["tokens_per_s"] for m in rows] == [128.0, 64.0, 32.0, 16.0]
    no_baselines = bench.bench_train(("fp8",), layers=1, dim=32, hidden=32, tokens=64, reps=1, baselines=())
    assert no_baselines["results"][0]["vs_bf16"] is None and no_baselines["results"][0]["vs_fp32"] is None


def test_bench_gemm_figures_from_the_medians(monkeypatch):
    """TFLOP/s = 2·M·N·K / t, ratios to BF16 = t / t_bf16, and the native GEMM's error relative
    to the emulated one, with a native backend stood in for on the CPU (a copy of the emulated
    result off by 0.1 %) for fp8 only; each timed case runs what its name says."""
    import minifloat.gemm as gemm
    import minifloat.measure.bench as bench
    from minifloat import quantize

    m, n, k = 32, 48, 256
    seen = {}
    medians = {"fp32": 1.0, "bf16": 0.5, "emulated:fp8": 4.0, "native:fp8": 0.25, "emulated:fp8_block128": 8.0}
    emulated = gemm.scaled_mm

    def fake_medians(cases, reps):
        seen.update(cases)
        return {key: medians[key] for key in cases}

    def scaled_mm(qa, qb, backend):
        out = emulated(qa, qb, backend="emulated")
        return out * 1.001 if backend == "native" else out

    monkeypatch.setattr(bench, "interleaved_medians", fake_medians)
    monkeypatch.setattr(gemm, "scaled_mm", scaled_mm)
    monkeypatch.setattr(gemm, "native_support", lambda scheme, dev: None if scheme.name == "fp8" else "not here")
    out = bench.bench_gemm(m, n, k, ("fp8", "fp8_block128"), reps=2)
    assert sorted(seen) == sorted(medians)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    assert torch.equal(seen["fp32"]()[0], a @ b.T) and seen["bf16"]()[0].dtype == torch.bfloat16
    qa, qb = quantize(a, "fp8_block128"), quantize(b, "fp8_block128x128")
    assert torch.equal(seen["emulated:fp8_block128"]()[0], emulated(qa, qb))
    flop = 2 * m * n * k
    assert (out["fp32_tflops"], out["bf16_tflops"]) == (flop / 1e12, flop / 0.5 / 1e12)
    fp8, block = out["results"]
    assert fp8["emulated_tflops"] == flop / 4.0 / 1e12 and fp8["emulated_vs_bf16"] == 8.0
    assert fp8["native_tflops"] == flop / 0.25 / 1e12 and fp8["native_vs_bf16"] == 0.5
    assert fp8["native_rel_error"] == pytest.approx(1e-3, rel=1e-3) and fp8["native_unavailable"] is None
    assert block["weight_scheme"] == "fp8_block128x128" and block["emulated_vs_bf16"] == 16.0
    assert block["native_tflops"] is None and block["native_rel_error"] is None and block["native_unavailable"] == "not here"


def test_bench_quantize_output_has_no_torchao_import_noise():
    """torchao logs a warning per CUDA-only extension it cannot load, on its first import: the
    benchmark holds those back (a fresh process, as torchao is imported once)."""
    pytest.importorskip("torchao")
    run = subprocess.run(
        [sys.executable, "-m", "minifloat", "bench", "quantize", "--size", "64x256", "--reps", "1", "--schemes", "mxfp8"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "mxfp8" in run.stdout and "x" in run.stdout.split("mxfp8")[1]  # the torchao column ran
    assert "Failed to load" not in run.stderr and "register_constant" not in run.stderr


def test_bench_cli_small(capsys):
    assert main(["bench", "quantize", "--size", "64x256", "--reps", "1", "--schemes", "fp8,mxfp4,nvfp4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["scheme"] for r in out["results"]] == ["fp8", "mxfp4", "nvfp4"]
    assert all(r["quantize_gelem_s"] > 0 and r["dequantize_vs_read"] > 0 for r in out["results"])
    assert out["torch_cast_gelem_s"] > 0 and out["torch_cast_vs_read"] > 0  # the context line's timing
    assert main(["bench", "quantize", "--size", "64x256", "--reps", "1", "--schemes", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "read bound" in text and "x.to(torch.float8_e4m3fn)" in text


def test_bench_json_is_strict_when_a_figure_is_not_finite(capsys, monkeypatch):
    import minifloat.measure.bench

    # e.g. a timer that read 0 s: the ratio is inf; scripts parsing --json must still read it
    monkeypatch.setattr(minifloat.measure.bench, "bench_quantize", lambda *a, **k: {"read_bound_gelem_s": float("inf")})
    assert main(["bench", "quantize", "--size", "64x256", "--reps", "1", "--json"]) == 0
    text = capsys.readouterr().out
    assert json.loads(text, parse_constant=lambda t: pytest.fail(f"bare {t} in --json"))["read_bound_gelem_s"] == "inf"


def _quantize_result(scheme, ao=None, stock=None):
    return {"scheme": scheme, "quantize_gelem_s": 3.5512, "quantize_vs_read": 0.5291,
            "quantize_vs_read_iqr": [0.4812, 0.5633], "dequantize_gelem_s": 3.4, "dequantize_vs_read": 0.5067,
            "dequantize_vs_read_iqr": [0.5, 0.6149], "torchao_gelem_s": ao, "speedup_vs_torchao": ao and 6.44,
            "torchao_stock_gelem_s": stock, "speedup_vs_torchao_stock": stock and 25.61}  # fmt: skip


def test_bench_quantize_table(capsys, monkeypatch):
    """The terminal table from `bench_quantize`'s figures, and the flags that reach it."""
    import minifloat.measure.bench as bench

    calls = []
    out = {"shape": [4096, 8192], "threads": 2, "reps": 9, "read_bound_gelem_s": 6.712,
           "read_bound_gelem_s_range": [5.004, 7.126], "torch_cast_gelem_s": 1.234,
           "torch_cast_vs_read": 0.184, "keeps_freed_memory": True, "torchao": True, "torchao_stock": True,
           "results": [_quantize_result("mxfp8", 0.5514, 0.1387), _quantize_result("fp8")]}  # fmt: skip
    monkeypatch.setattr(bench, "bench_quantize", lambda *size, **kw: calls.append((size, kw)) or out)
    assert main(["bench", "quantize"]) == 0
    assert calls.pop() == ((4096, 8192), {"schemes": bench.DEFAULT_SCHEMES, "reps": 9})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("input 4096x8192 float32, 2 threads, median of 9; read bound (sum) 6.71 Gelem/s "
                        "(5.00-7.13 over the rounds)")
    assert lines[1].endswith("(no amax, no scale): 1.23 Gelem/s, 0.18 x read")
    assert lines[2].startswith("allocator: freed buffers stay in the heap") and lines[3].startswith("torchao: in this")
    assert lines[4] == "x read: the ratio to the read bound, and in brackets its quartiles over the rounds"
    assert lines[5].split() == ["scheme", "quant", "Gelem/s", "x", "read", "dequant", "Gelem/s", "x", "read",
                                "torchao", "speedup", "stock", "speedup"]  # fmt: skip
    assert lines[6].split() == ["mxfp8", "3.55", "0.53", "[0.48-0.56]", "3.40", "0.51", "[0.50-0.61]",
                                "0.551", "6.4x", "0.139", "25.6x"]  # fmt: skip
    assert lines[7].split() == ["fp8", "3.55", "0.53", "[0.48-0.56]", "3.40", "0.51", "[0.50-0.61]", "-", "-", "-", "-"]
    out.update(torch_cast_gelem_s=None, keeps_freed_memory=False, torchao=False, torchao_stock=False)
    assert main(["bench", "quantize", "--size", "64x256", "--schemes", "MXFP8,fp8", "--reps", "2"]) == 0
    assert calls.pop() == ((64, 256), {"schemes": ("mxfp8", "fp8"), "reps": 2})
    assert main(["bench", "quantize", "--size", "1X1"]) == 0  # the smallest input
    assert calls.pop()[0] == (1, 1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("allocator: glibc default") and lines[2].startswith("torchao is not installed")
    assert main(["bench", "quantize", "--reps", "0"]) == 2
    assert "--reps must be ≥ 1, got 0" in capsys.readouterr().err


def test_bench_train_and_gemm_tables(capsys, monkeypatch):
    import minifloat.measure.bench as bench

    calls = []
    train = {"mlp": {"layers": 4, "dim": 1024, "hidden": 4096, "tokens": 2048}, "threads": 2, "reps": 3,
             "results": [{"model": "fp32", "step_s": 1.5, "vs_bf16": None, "vs_fp32": 1.0, "tokens_per_s": 1365.3},
                         {"model": "fp8", "step_s": 2.25, "vs_bf16": 0.75, "vs_fp32": 1.5, "tokens_per_s": 910.2}]}  # fmt: skip
    monkeypatch.setattr(bench, "train_baselines", lambda bf16: (("fp32", "torchao"), "BF16 baseline skipped: ..."))
    monkeypatch.setattr(bench, "bench_train", lambda recipes, **kw: calls.append((recipes, kw)) or train)
    assert main(["bench", "train"]) == 0
    recipes, kw = calls.pop()
    assert recipes == bench.TRAIN_DEFAULT_RECIPES and kw["reps"] == 3 and kw["baselines"] == ("fp32", "torchao")
    assert (kw["layers"], kw["dim"], kw["hidden"], kw["tokens"]) == (4, 1024, 4096, 2048) and kw["progress"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "BF16 baseline skipped: ..."
    assert lines[1] == "4 x (1024->4096->1024) MLP, 2048 tokens, 2 threads, median of 3 (forward + backward + SGD step)"
    assert lines[3].split() == ["fp32", "1.500", "-", "1.00", "1365"] and lines[4].split() == ["fp8", "2.250", "0.75", "1.50", "910"]

    gemm = {"shape": [1024, 1024, 1024], "device": "cpu", "device_name": "cpu", "threads": 2, "reps": 9,
            "fp32_tflops": 0.123, "bf16_tflops": None, "bf16_native": False,
            "results": [{"scheme": "fp8", "emulated_tflops": 0.0456, "emulated_vs_bf16": None, "native_tflops": None,
                         "native_vs_bf16": None, "native_rel_error": None, "native_unavailable": "no GPU"},
                        {"scheme": "mxfp8", "emulated_tflops": 0.0312, "emulated_vs_bf16": 2.5, "native_tflops": 1.5,
                         "native_vs_bf16": 0.5, "native_rel_error": 1.21e-3, "native_unavailable": None}]}  # fmt: skip
    monkeypatch.setattr(bench, "bench_gemm", lambda *shape, **kw: calls.append((shape, kw)) or gemm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gemm", "--no-bf16"]) == 0
    shape, kw = calls.pop()
    assert shape == (1024, 1024, 1024, bench.GEMM_DEFAULT_SCHEMES) and kw["bf16"] is False and kw["reps"] == 9
    assert kw["device"] == torch.device("cpu")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "a·bᵀ 1024x1024 · (1024x1024)ᵀ on cpu (cpu), 2 threads, median of 9; FP32 0.12 TFLOP/s, BF16 - TFLOP/s"
    assert lines[2].split() == ["fp8", "0.046", "-", "-", "-", "-"]
    assert lines[3].split() == ["mxfp8", "0.031", "2.50", "1.500", "0.50", "1.2e-03"]
    assert lines[4] == "no native GEMM for fp8: no GPU" and len(lines) == 5  # no BF16 timed: nothing to say of it
    gemm.update(bf16_tflops=0.5)  # a BF16 time from a CPU without BF16 units is said to be torch's emulation
    assert main(["bench", "gemm"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("BF16 here is torch's emulation: this CPU has no BF16 units")
    gemm.update(bf16_native=True)
    assert main(["bench", "gemm"]) == 0
    assert "emulation" not in capsys.readouterr().out
    calls.clear()
    assert main(["bench", "gemm", "--device", "cuda"]) == 2
    assert "--device cuda: this torch sees no CUDA device; use --device cpu" in capsys.readouterr().err
    assert main(["bench", "gemm", "--shape", "8x16x32", "--schemes", "nvfp4"]) == 0
    assert calls.pop() == ((8, 16, 32, ("nvfp4",)), {"device": torch.device("cpu"), "reps": 9, "bf16": True})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: the default device and shape grow
    assert main(["bench", "gemm", "--json"]) == 0
    assert calls.pop()[0][:3] == (4096, 4096, 4096) and calls == []
