import importlib.util
import json
import subprocess
import sys

import pytest
import torch

import minifloat
from minifloat import FORMATS
from minifloat.cli import build_parser, main


def test_formats_table_is_generated_from_definitions(capsys):
    assert main(["formats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["format", "bits", "E"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert list(rows) == list(FORMATS)
    for name, fmt in FORMATS.items():
        row = rows[name]
        assert row[1:5] == [str(fmt.bits), str(fmt.exp_bits), str(fmt.man_bits), str(fmt.bias)]
        assert float(row[7]) == pytest.approx(fmt.max, rel=1e-3)
        assert row[12] == f"{fmt.bits / 16:.3g}x"
    assert rows["e5m2"][7] == "57344" and rows["e4m3"][7] == "448"


def test_formats_json(capsys):
    assert main(["formats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [f.describe() for f in FORMATS.values()]


def test_formats_plot_writes_png(tmp_path, capsys):
    out = tmp_path / "sub" / "formats.png"
    assert main(["formats", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["formats.png"]  # no temp file left


def test_the_plotted_error_envelope_is_each_formats_rounding_error():
    """Panel (a)'s curve: at most half an ulp relative (2^-(M+1)) and at least half that in
    every bin of the normal range; 1 where values flush to zero; near 1 far above max."""
    from minifloat.report.format_plots import ELEMENT_FORMATS, relative_error_envelope

    for fmt in ELEMENT_FORMATS:
        centers, worst = relative_error_envelope(fmt)  # 140 bins over [1e-8, 1e6]
        edges = centers.new_tensor([1e-8, 1e6]).log().diff() / 140 / 2  # half a bin, in log space
        lo, hi = (centers.log() - edges).exp(), (centers.log() + edges).exp()
        half_ulp = 2.0 ** -(fmt.man_bits + 1)
        normal = (lo >= fmt.min_normal) & (hi <= fmt.max)
        assert normal.sum() >= 6, fmt.name  # E2M3's normal range, [1, 7.5], is the narrowest
        assert bool((worst[normal] <= half_ulp).all() and (worst[normal] >= half_ulp / 2).all()), fmt.name
        assert bool((worst[hi < fmt.min_subnormal / 2] == 1.0).all()), fmt.name
        assert bool((worst[lo > 100 * fmt.max] > 0.99).all()), fmt.name


def test_plot_to_unwritable_path_is_a_clean_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["formats", "--plot", str(blocker / "f.png")]) == 1
    assert "minifloat formats: error:" in capsys.readouterr().err


def test_console_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "minifloat", "formats"], capture_output=True, text=True)
    assert done.returncode == 0 and "e2m1" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "minifloat", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr and "Traceback" not in bad.stderr


def test_version_names_minifloat_and_torch(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"minifloat {minifloat.__version__} (torch {torch.__version__})"


def test_info_lists_every_recipe_with_its_backend(capsys):
    from minifloat.recipes import RECIPES

    assert main(["info", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cpu = out["devices"][0]
    assert cpu["device"] == "cpu"
    assert [r["recipe"] for r in cpu["recipes"]] == list(RECIPES)
    assert all(r["backend"] == "emulated" and r["why"] for r in cpu["recipes"])
    assert main(["info"]) == 0
    said = capsys.readouterr().out
    assert "mxfp4" in said
    if cpu["decode_kernels"].startswith(("avx", "portable")):  # built: the probe's peak beside the ISA path
        assert "float32 multiply-adds at most" in said


def test_bench_train_times_recipes_against_baselines(capsys):
    argv = ["bench", "train", "--recipes", "fp8,mxfp8", "--layers", "1", "--dim", "64", "--hidden", "128",
            "--tokens", "64", "--reps", "1", "--json", "--bf16"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    models = [r["model"] for r in out["results"]]
    torchao = ["torchao-float8"] if importlib.util.find_spec("torchao") else []
    assert models == ["bf16", "fp32", *torchao, "fp8", "mxfp8"]
    bf16, fp32 = out["results"][:2]
    assert bf16["vs_bf16"] == 1.0 and fp32["vs_fp32"] == 1.0  # the figures themselves: test_bench
    assert out["mlp"] == {"layers": 1, "dim": 64, "hidden": 128, "tokens": 64} and out["reps"] == 1
    assert out["bf16_skipped"] is None


def test_bench_train_skips_an_emulated_bf16_baseline_unless_asked(capsys, monkeypatch):
    import minifloat.measure.bench as bench

    assert bench.train_baselines(None, slowdown=lambda: 1.5) == (("bf16", "fp32", "torchao"), None)
    assert bench.train_baselines(True, slowdown=lambda: 100.0) == (("bf16", "fp32", "torchao"), None)
    assert bench.train_baselines(False, slowdown=lambda: 1.5) == (("fp32", "torchao"), None)
    # BF16 units make a BF16 matmul 0.5-2x the FP32 time; without them it is ~100x: the line is 8x.
    assert bench.train_baselines(None, slowdown=lambda: 8.0)[0] == ("bf16", "fp32", "torchao")
    assert bench.train_baselines(None, slowdown=lambda: 8.1)[0] == ("fp32", "torchao")
    baselines, note = bench.train_baselines(None, slowdown=lambda: 97.0)
    assert baselines == ("fp32", "torchao") and "97x the FP32 time" in note and "--bf16" in note
    monkeypatch.setattr(bench, "bf16_matmul_slowdown", lambda: 97.0)
    argv = ["bench", "train", "--recipes", "fp8", "--layers", "1", "--dim", "32", "--hidden", "32",
            "--tokens", "16", "--reps", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "BF16 baseline skipped: a BF16 matmul takes 97x" in out
    rows = [line.split()[0] for line in out.splitlines()[3:]]
    assert "bf16" not in rows and rows[0] == "fp32" and rows[-1] == "fp8", out


def test_bench_gemm_times_emulated_gemms_and_says_why_not_native(capsys):
    argv = ["bench", "gemm", "--device", "cpu", "--shape", "32x48x256", "--schemes", "fp8_block128,mxfp6_e3m2",
            "--reps", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"] == [32, 48, 256] and out["fp32_tflops"] > 0 and out["bf16_tflops"] > 0
    assert out["bf16_native"] is minifloat.gemm.native_bf16_cpu()  # this CPU's own answer
    block, mx6 = out["results"]
    assert block["weight_scheme"] == "fp8_block128x128"  # DeepSeek-V3: 1×128 activations, 128×128 weights
    assert block["emulated_tflops"] > 0 and block["emulated_vs_bf16"] > 0
    assert block["native_tflops"] is None and "no native low-precision GEMM on cpu" in block["native_unavailable"]
    assert "no GEMM for e3m2" in mx6["native_unavailable"]
    assert main(["bench", "gemm", "--device", "cpu", "--shape", "32x48x64", "--schemes", "nvfp4", "--reps", "1", "--no-bf16"]) == 0
    assert "no native GEMM for nvfp4" in capsys.readouterr().out


def test_bench_gemm_rejects_a_bad_shape(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "gemm", "--shape", "32x48"])
    assert "MxNxK" in capsys.readouterr().err
    for bad in ("64", "64x0", "64xa"):
        with pytest.raises(SystemExit):
            main(["bench", "quantize", "--size", bad])
        assert f"size must look like 4096x8192, got '{bad}'" in capsys.readouterr().err


def test_bench_train_rejects_unknown_recipe_before_timing(capsys):
    assert main(["bench", "train", "--recipes", "fp7"]) == 2
    assert "unknown recipe 'fp7'" in capsys.readouterr().err


def test_train_and_compare_flags_reach_the_config():
    from minifloat.cli import build_parser
    from minifloat.cli.train import config_from_args

    for cmd in (["train", "--precision", "nvfp4"], ["compare"]):
        args = build_parser().parse_args([*cmd, "--model", "tiny", "--seq-len", "32", "--high-precision-last", "1",
                                          "--lr", "2e-3", "--eval-batches", "3", "--telemetry-every", "5"])  # fmt: skip
        c = config_from_args(args, precision="nvfp4")
        assert (c.high_precision_last, c.lr, c.eval_batches, c.telemetry_every) == (1, 2e-3, 3, 5)


def test_train_and_compare_defaults_are_the_libraries():
    """A flag left out means what `TrainConfig` means; `minifloat compare` only changes the
    precision to its reference's."""
    import dataclasses

    from minifloat.cli import build_parser
    from minifloat.cli.train import config_from_args
    from minifloat.measure.compare import DEFAULT_PRECISIONS
    from minifloat.train import TrainConfig

    assert config_from_args(build_parser().parse_args(["train"])) == TrainConfig()
    compare_args = build_parser().parse_args(["compare"])
    first = DEFAULT_PRECISIONS[0]
    assert config_from_args(compare_args, precision=first) == dataclasses.replace(TrainConfig(), precision=first)


def _help_entries(text: str) -> dict[str, str]:
    """A --help text's option entries, unwrapped, by each entry's first option string."""
    entries, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {" ".join(k.split()): " ".join(v.split()) for k, v in entries.items()}


# Each command with the arguments it needs to parse: its defaults are what parse_args returns.
COMMANDS = {"train": [], "compare": [], "bench": ["quantize"], "error": [], "formats": [], "info": []}


def _help(capsys, name: str) -> dict[str, str]:
    with pytest.raises(SystemExit):
        main([name, "--help"])
    return _help_entries(capsys.readouterr().out)


def test_help_states_each_options_default_once(capsys):
    """Every option whose default is a value (not None or an off switch) says it in --help,
    once: printed by the formatter, or in the option's own words where they explain it."""
    checked = 0
    for name, needed in COMMANDS.items():
        defaults = vars(build_parser().parse_args([name, *needed]))
        for option, entry in _help(capsys, name).items():
            default = defaults.get(option.lstrip("-").replace("-", "_"))
            if option in ("-h", "--help") or default is None or default is False:
                continue
            assert entry.count("default") == 1, (name, entry)
            if isinstance(default, int | float | str):
                assert f"default: {default})" in entry or f"default {default}" in entry, (name, entry)
            checked += 1
    assert checked >= 25
    train = _help(capsys, "train")
    assert train["--steps"].endswith("optimizer steps (default: 200)")
    assert "0 for none (default: 50)" in train["--eval-every"]
    assert "0 for only the one at the end" in _help(capsys, "compare")["--eval-every"]
