import dataclasses
import json
import math
import resource
import sys
from pathlib import Path

import pytest

import minifloat
from minifloat.cli import main
from minifloat.measure.compare import (
    _diverged,
    compare,
    parse_precisions,
    run_fields,
    run_metrics,
    weight_bytes,
)
from minifloat.models.gpt import GPT_SIZES
from minifloat.train import TrainConfig
from minifloat.train.runlog import read_log

RUN_KEYS = {
    "precision": str, "status": str, "final_train_loss": float, "final_val_loss": float, "val_loss_delta_pct": float,
    "step_time_s": float, "step_time_ratio": float, "tokens_per_s": float, "weight_bytes": int,
    "master_weight_bytes": int, "peak_rss_bytes": int, "skipped_steps": int, "nonfinite_steps": int,
    "steps_completed": int, "recipe": dict, "log": str,
}  # fmt: skip


def _base(**kw):
    fields = dict(model="tiny", steps=6, batch_size=4, seq_len=32, eval_every=3, eval_batches=2, max_bytes=200_000,
                  warmup=2, telemetry_every=2)  # fmt: skip
    fields.update(kw)
    return TrainConfig(**fields)


def _tiny_linears():
    """(out, in) of every Linear of the tiny GPT but the tied LM head, from its config."""
    d, layers = GPT_SIZES["tiny"].n_embd, GPT_SIZES["tiny"].n_layer
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers


def test_parse_precisions_checks_names():
    assert parse_precisions("bf16, fp8,nvfp4") == ["bf16", "fp8", "nvfp4"]
    with pytest.raises(minifloat.MinifloatError, match="unknown precision 'fp7'"):
        parse_precisions("bf16,fp7")
    with pytest.raises(minifloat.MinifloatError, match="needs distinct names, got fp8,fp8"):
        parse_precisions("fp8,fp8")
    with pytest.raises(minifloat.MinifloatError, match="needs distinct names, got none"):
        parse_precisions(" , ")
    assert parse_precisions(("fp32", "mxfp4")) == ["fp32", "mxfp4"]  # a sequence, as compare() takes


def test_a_precision_carries_training_options_and_the_rest_keep_their_defaults():
    label = "mxfp4-tseng@states=fp8-dre@master=bf16-sr@last=1"
    assert parse_precisions(f"fp8,{label}") == ["fp8", label]
    assert run_fields(label) == {"precision": "mxfp4-tseng", "optimizer_states": "fp8-dre", "master": "bf16-sr",
                                 "high_precision_first": 0, "high_precision_last": 1, "lora_init": "zero",
                                 "base_compute": "auto", "precision_switch": 0.0, "outlier_channels": 0}  # fmt: skip
    assert run_fields("fp8") == {"precision": "fp8", "optimizer_states": "fp32", "master": "fp32",
                                 "high_precision_first": 0, "high_precision_last": 0, "lora_init": "zero",
                                 "base_compute": "auto", "precision_switch": 0.0, "outlier_channels": 0}  # fmt: skip
    # a packed LoRA base's compute dtype reaches the packed bases; the BF16 reference keeps its own
    lora = TrainConfig(pretrained="m", steps=1, lora_rank=4, precision="nvfp4", base_compute="fp32")
    assert run_fields("nvfp4", lora)["base_compute"] == "fp32" and run_fields("bf16", lora)["base_compute"] == "auto"
    assert run_fields("nvfp4@compute=bf16", lora)["base_compute"] == "bf16"
    with pytest.raises(minifloat.MinifloatError, match="--base-compute fine-tune a pretrained model: name it"):
        TrainConfig(model="tiny", steps=1, base_compute="bf16")  # the built-in GPT has no packed base
    with pytest.raises(minifloat.MinifloatError, match="--base-compute sets the products of a packed base; --base bf16"):
        TrainConfig(pretrained="m", steps=1, lora_rank=4, precision="bf16", base_compute="bf16")
    # options the command line gave reach every precision that does not name its own
    cli = TrainConfig(model="tiny", steps=1, high_precision_last=1, optimizer_states="bf16")
    assert run_fields("fp8", cli)["high_precision_last"] == 1 and run_fields("fp8@states=fp8", cli)["optimizer_states"] == "fp8"
    with pytest.raises(minifloat.MinifloatError, match="options after @ are key=value with a key among states, master"):
        parse_precisions("fp8@state=fp8")
    with pytest.raises(minifloat.MinifloatError, match="last= takes a whole number of blocks, got 'x'"):
        run_fields("fp8@last=x")
    # a precision switch: a recipe's own, or the command line's for the recipes only
    assert run_fields("nvfp4@switch=0.1")["precision_switch"] == 0.1
    cli = TrainConfig(model="tiny", steps=10, precision="nvfp4", precision_switch=0.2)
    assert run_fields("mxfp4", cli)["precision_switch"] == 0.2 and run_fields("bf16", cli)["precision_switch"] == 0.0
    with pytest.raises(minifloat.MinifloatError, match="switch= takes a fraction of the steps, e.g. 0.1; got 'ten'"):
        run_fields("nvfp4@switch=ten")
    # outlier channels: a recipe's own, or the command line's for the recipes only
    assert run_fields("nvfp4@outliers=8@switch=0.1")["outlier_channels"] == 8
    cli = TrainConfig(model="tiny", steps=10, precision="nvfp4", outlier_channels=4)
    assert run_fields("mxfp4", cli)["outlier_channels"] == 4 and run_fields("bf16", cli)["outlier_channels"] == 0
    with pytest.raises(minifloat.MinifloatError, match="outliers= takes a whole number of channels, got '-2'"):
        run_fields("nvfp4@outliers=-2")
    with pytest.raises(minifloat.MinifloatError, match="--master bf16-sr keeps the weights in BF16"):  # checked before any run
        compare(["fp32", "fp32@master=bf16-sr"], TrainConfig(model="tiny", steps=1), "/nonexistent/never", plots=False)


@pytest.mark.parametrize(
    "precision, bytes_per_weight",
    [
        # One FP32 scale per tensor / one E8M0 per 32 / E2M1 pairs + one E4M3 per 16×16 + FP32 tensor scale.
        ("fp8", lambda o, i: o * i + 4),
        ("mxfp8", lambda o, i: o * i + o * i // 32),
        ("mxfp4-tseng", lambda o, i: o * i // 2 + o * i // 32),
        ("mxfp4", lambda o, i: o * i // 2 + o * i // 32),  # its recipe keeps the first block: those weights count 2 bytes
        ("nvfp4", lambda o, i: o * i // 2 + o * i // 256 + 4),
    ],
)
def test_weight_bytes_follow_the_packed_formats(precision, bytes_per_weight):
    got = weight_bytes(TrainConfig(precision=precision, model="tiny", seq_len=32))
    linears = _tiny_linears()[4:] if precision == "mxfp4" else _tiny_linears()
    quantized = sum(o * i for o, i in linears)
    assert got["quantized_params"] == quantized
    assert got["weight_bytes"] == sum(bytes_per_weight(o, i) for o, i in linears) + 2 * (
        got["params"] - quantized
    )
    assert got["master_weight_bytes"] == 4 * got["params"]
    assert (
        weight_bytes(TrainConfig(precision="fp32", model="tiny", seq_len=32))["weight_bytes"]
        == 4 * got["params"]
    )
    assert (
        weight_bytes(TrainConfig(precision="bf16", model="tiny", seq_len=32))["weight_bytes"]
        == 2 * got["params"]
    )


def test_run_metrics_from_a_log():
    recs = [
        {"step": i + 1, "loss": 5.0 - 0.1 * i, "step_time_s": 1.0 if i else 9.0, "skipped_steps": 0}
        for i in range(20)
    ]
    recs[9]["val_loss"], recs[19]["val_loss"] = 4.5, 3.5
    recs[5]["step_time_s"] = 3.0
    m = run_metrics(recs, _base())
    assert m["final_train_loss"] == pytest.approx((3.2 + 3.1) / 2)  # last 10 %: 2 steps
    assert m["final_val_loss"] == 3.5 and m["step_time_s"] == 1.0  # the median skips warm-up
    assert m["tokens_per_s"] == 4 * 32 and m["nonfinite_steps"] == 0
    assert not _diverged(m)
    recs[-1]["loss"] = float("nan")
    assert _diverged(run_metrics(recs, _base()))
    rising = [dict(r, loss=1.0 + 0.1 * i) for i, r in enumerate(recs)]
    assert _diverged(run_metrics(rising, _base()))
    falling = {"first_train_loss": 5.0, "final_train_loss": 3.0, "final_val_loss": 3.1, "nonfinite_steps": 0}
    assert not _diverged(falling)
    assert _diverged(dict(falling, nonfinite_steps=1))  # one NaN step on the way is enough
    assert _diverged(dict(falling, final_val_loss=None))  # no validation loss: not a finished run
    tuned = {"first_train_loss": 2.73, "final_train_loss": 2.83, "final_val_loss": 3.19, "base_val_loss": 3.40, "nonfinite_steps": 0}
    assert not _diverged(tuned)  # a fine-tune whose first batch happened to be easy, its validation loss down
    assert _diverged(dict(tuned, final_val_loss=3.41))  # a fine-tune that made the model worse


def test_run_metrics_take_the_worst_telemetry_and_count_the_bad_steps():
    recs = [{"step": i + 1, "loss": 3.0, "step_time_s": 1.0, "skipped_steps": 0} for i in range(10)]
    assert run_metrics(recs, _base())["max_saturated"] is None  # no telemetry: None, not 0
    recs[2]["telemetry"] = {"max_saturated": 0.25, "max_flushed": 0.001}
    recs[5]["telemetry"] = {"max_saturated": 0.5, "max_flushed": 0.0,
                            "first_nonfinite": {"step": 6, "layer": "blocks.0.mlp.fc1", "where": "output"}}
    recs[7]["telemetry"] = {"first_nonfinite": {"step": 8, "layer": "head", "where": "output"}}
    recs[6]["nonfinite"], recs[7]["loss"] = True, float("inf")
    recs[-1]["skipped_steps"], recs[-1]["val_loss"] = 2, 3.0
    assert not _diverged(run_metrics([dict(r, nonfinite=False, loss=3.0) for r in recs], _base()))
    m = run_metrics(recs, _base())
    assert (m["max_saturated"], m["max_flushed"]) == (0.5, 0.001)
    assert m["first_nonfinite"]["layer"] == "blocks.0.mlp.fc1"  # the first one, not the last
    assert m["nonfinite_steps"] == 2 and m["skipped_steps"] == 2 and m["steps_completed"] == 10
    assert _diverged(m)  # finite final losses, but non-finite steps on the way
    assert run_metrics([], _base()) == {"steps_completed": 0}


def test_compare_writes_metrics_report_and_plots(tmp_path):
    echoed = []
    metrics = compare(["fp32", "fp8", "nvfp4"], _base(), tmp_path, echo=echoed.append)
    # The parent echoes each child's progress lines, tagged, but not the child's JSON summary.
    assert echoed[0] == "[1/3] fp32: tiny model, 6 steps" and "  [nvfp4] step 6/6 loss" in "\n".join(echoed)
    assert not any('"final"' in line for line in echoed)
    # Peak RSS from wait4 is in KiB on Linux: no run's peak is above what getrusage reports for
    # the largest child this process has waited for.
    children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert max(run["peak_rss_bytes"] for run in metrics["runs"]) <= children_peak
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert [r["precision"] for r in on_disk["runs"]] == ["fp32", "fp8", "nvfp4"]
    for run in on_disk["runs"]:
        for key, kind in RUN_KEYS.items():
            assert isinstance(run[key], kind), (run["precision"], key, run[key])
        assert run["status"] == "ok" and run["steps_completed"] == 6
        log = [json.loads(line) for line in Path(run["log"]).read_text().splitlines()]
        assert run["final_val_loss"] == log[-1]["val_loss"]
        assert run["peak_rss_bytes"] > 50 * 2**20
        assert run["wall_time_s"] > sum(r["step_time_s"] for r in log)  # the child's start-up too
    ref, fp8, nvfp4 = on_disk["runs"]
    assert ref["val_loss_delta_pct"] == 0.0 and ref["step_time_ratio"] == 1.0  # the formulas: literal figures below
    assert nvfp4["weight_bytes"] < fp8["weight_bytes"] < ref["weight_bytes"]
    # Same seed, same data order: step 1 sees the same batch and initial weights in every
    # precision, so the first losses agree to quantization error only.
    firsts = [run["first_train_loss"] for run in on_disk["runs"]]
    assert max(firsts) - min(firsts) < 0.02 and len(set(firsts)) > 1
    assert on_disk["config"]["precisions"] == ["fp32", "fp8", "nvfp4"] and on_disk["config"]["steps"] == 6
    assert on_disk["env"]["torch"] and on_disk["env"]["backends"]["fp8"] in ("emulated", "native")
    assert on_disk["runs"][1]["recipe"]["recipe"] == "delayed"

    report = (tmp_path / "report.md").read_text()
    assert "| fp8 " in report and "![Loss](loss.png)" in report and "scales.png" in report
    assert '"amax_history_len": 1024' in report  # the exact recipe
    for name in ("loss.png", "scales.png", "speed_memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_reports_failed_and_diverged_runs(tmp_path, capsys, monkeypatch):
    import minifloat.measure.compare as cmp

    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\x00\x01" * 5000)
    args = ["compare", "--precisions", "fp32,fp8", "--model", "tiny", "--steps", "3", "--batch-size", "2",
            "--seq-len", "16", "--no-plots", "--out", str(tmp_path / "fail")]  # fmt: skip
    assert main([*args, "--data", str(bad)]) == 2  # a bad corpus fails once, before any run
    assert "binary file" in capsys.readouterr().err and not (tmp_path / "fail").exists()

    # An earlier comparison in --out is kept unless --overwrite says otherwise.
    stale = tmp_path / "fail" / "runs" / "fp32" / "log.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"step": 0, "loss": 2.5, "step_time_s": 0.1, "lr": 1e-3}) + "\n")
    (tmp_path / "fail" / "report.md").write_text("an earlier report")
    assert main(args) == 2
    assert "already holds a comparison (report.md, runs); pass --overwrite" in capsys.readouterr().err
    assert stale.exists() and (tmp_path / "fail" / "report.md").read_text() == "an earlier report"
    # Runs that fail (here: children that exit before logging a step) are reported as failed,
    # never with the figures the earlier comparison left.
    monkeypatch.setattr(cmp, "_run_child", lambda cmd, echo: (1, 0, ["RuntimeError: out of memory"]))
    assert main([*args, "--overwrite"]) == 1
    metrics = json.loads((tmp_path / "fail" / "metrics.json").read_text())
    assert [r["status"] for r in metrics["runs"]] == ["failed", "failed"]
    assert [r["steps_completed"] for r in metrics["runs"]] == [0, 0]
    assert "out of memory" in metrics["runs"][0]["error"]
    assert "failed" in capsys.readouterr().out
    monkeypatch.undo()

    # A learning rate far too large: the loss goes NaN.
    metrics = compare(
        ["fp32"],
        _base(lr=1e8, warmup=1, steps=8, grad_clip=0.0),
        tmp_path / "div",
        echo=lambda s: None,
        plots=False,
    )
    run = metrics["runs"][0]
    assert run["status"] == "diverged", run
    assert math.isnan(run["final_train_loss"]) and math.isnan(run["final_val_loss"])
    assert "diverged" in (tmp_path / "div" / "report.md").read_text()
    # metrics.json is strict JSON: the NaN losses are the string "nan", which float() reads back.
    strict = json.loads((tmp_path / "div" / "metrics.json").read_text(), parse_constant=_refuse)
    assert strict["runs"][0]["final_train_loss"] == "nan" == strict["runs"][0]["final_val_loss"]
    # So is every line of the run's log.jsonl; read_log gives the floats back.
    lines = Path(run["log"]).read_text().splitlines()
    assert any(json.loads(line, parse_constant=_refuse)["loss"] == "nan" for line in lines)
    records = read_log(Path(run["log"]))
    assert any(math.isnan(r["loss"]) for r in records)
    assert [r["nonfinite"] for r in records] == [not math.isfinite(r["loss"]) for r in records]


def _refuse(token: str):
    raise ValueError(f"{token} is not JSON")


def test_loss_smoothing_is_centred():
    from minifloat.report.comparison import _smooth

    assert _smooth([1.0, 2.0, 3.0, 4.0, 5.0], 1) == [1.5, 2.0, 3.0, 4.0, 4.5]
    assert _smooth([1.0, float("nan"), 3.0], 1)[0] == 1.0  # non-finite: left as is
    assert _smooth([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [2.0, 2.5, 3.0, 3.5, 4.0]  # shorter windows at the ends
    assert _smooth([1.0, 5.0, 2.0], 0) == [1.0, 5.0, 2.0]


def test_loss_curves_are_what_the_loss_plot_draws(tmp_path):
    """Raw and smoothed training loss, the smoothed difference to the first run's over the
    steps both have, and the validation points; no difference curves when the reference,
    the first run, left no log (not a silent switch to the second run's)."""
    from minifloat.report.comparison import loss_curves

    def centred(values, half=2):  # the oracle: a mean over the window, cut at the ends
        return [sum(w) / len(w) for w in (values[max(0, i - half) : i + half + 1] for i in range(len(values)))]

    def run(name, losses, status="ok", val=()):
        log = tmp_path / f"{name}.jsonl"
        recs = [{"step": i + 1, "loss": v} | ({"val_loss": 9.0 - i} if i + 1 in val else {}) for i, v in enumerate(losses)]
        log.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return {"precision": name, "status": status, "log": str(log)}

    ref_losses = [5.0 - 0.01 * i + 0.1 * (i % 3) for i in range(120)]
    other = [v + 0.2 + 0.05 * (i % 2) for i, v in enumerate(ref_losses[:100])]
    metrics = {"runs": [run("bf16", ref_losses, val=(60, 120)), run("fp8", other, "diverged", val=(60,)),
                        run("nvfp4", [])]}  # fmt: skip
    ref, fp8 = loss_curves(metrics)  # the run with an empty log has no curves
    assert (ref["label"], fp8["label"]) == ("bf16", "fp8 (diverged)")
    assert fp8["steps"] == list(range(1, 101)) and fp8["raw"] == other
    assert fp8["smooth"] == pytest.approx(centred(other)) and ref["smooth"] == pytest.approx(centred(ref_losses))
    assert ref["delta"] == [0.0] * 120
    assert fp8["delta"] == pytest.approx([a - b for a, b in zip(centred(other), centred(ref_losses)[:100], strict=True)])
    assert fp8["delta"][10] > 0.2  # the run's loss minus the reference's, not the other way round
    assert ref["val"] == [(60, 9.0 - 59), (120, 9.0 - 119)] and fp8["val"] == [(60, 9.0 - 59)]
    metrics["runs"][0]["log"] = str(tmp_path / "missing.jsonl")
    (fp8,) = loss_curves(metrics)
    assert fp8["delta"] is None and fp8["smooth"] == pytest.approx(centred(other))


def test_scale_series_are_what_the_scales_plot_draws(tmp_path):
    """Per operand, one series per run that recorded it; an amax of 0 drawn at 1e-30 and a
    missing (0, None, inf, NaN) scale as a gap on the log axes. No telemetry: no plot, no file."""
    from minifloat.report.comparison import SCALE_OPERANDS, plot_scales, scale_series

    act, weight, _ = SCALE_OPERANDS
    fp8_recs = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 3.0, "telemetry": {"amax": {act: 2.0}, "scale": {act: 224.0}}},
        {"step": 4, "loss": 3.0, "telemetry": {"amax": {act: 0.0, weight: 0.5}, "scale": {act: 0.0, weight: None}}},
        {"step": 6, "loss": 3.0, "telemetry": {"amax": {act: 4.0, weight: 0.25}, "scale": {act: float("inf"), weight: 8.0}}},
    ]  # fmt: skip
    logs = {"bf16": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}], "fp8": fp8_recs}
    for name, recs in logs.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    metrics = {"runs": [{"precision": name, "log": str(tmp_path / f"{name}.jsonl")} for name in logs]}
    series = scale_series(metrics)
    assert list(series) == list(SCALE_OPERANDS) and series[SCALE_OPERANDS[2]] == []
    ((a,), (w,)) = series[act], series[weight]
    assert (a["precision"], a["steps"], a["amax"]) == ("fp8", [2, 4, 6], [2.0, 1e-30, 4.0])
    assert a["scale"][0] == 224.0 and math.isnan(a["scale"][1]) and math.isnan(a["scale"][2])
    assert (w["steps"], w["amax"], w["scale"][1]) == ([4, 6], [0.5, 0.25], 8.0) and math.isnan(w["scale"][0])
    assert plot_scales(metrics, tmp_path / "scales.png")
    assert (tmp_path / "scales.png").read_bytes()[:4] == b"\x89PNG"
    assert not plot_scales({"runs": metrics["runs"][:1]}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_speed_memory_panels_are_what_the_bar_plot_draws():
    from minifloat.report.comparison import speed_memory_panels

    runs = [{"step_time_s": 0.25, "weight_bytes": 3 * 2**20, "peak_rss_bytes": 2**29}, {"step_time_s": None}]
    assert speed_memory_panels({"runs": runs}) == [
        ("step time (s, median)", [0.25, 0]), ("weights at rest (MiB)", [3.0, 0]), ("peak RSS of the run (MiB)", [512.0, 0]),
    ]  # fmt: skip


def test_write_report_text(tmp_path):
    """report.md's prose and sections from the metrics alone: the setup line, the runs that
    did not finish and why, the figures only when drawn, the telemetry rows, the recipes, the
    configuration and environment as JSON."""
    from minifloat.report.comparison import write_report

    log = tmp_path / "bf16.jsonl"
    log.write_text("".join(json.dumps({"step": i, "loss": 3.0 - 0.1 * i}) + "\n" for i in range(1, 4)))
    config = {"model": "tiny", "steps": 3, "batch_size": 4, "seq_len": 32, "grad_accum": 2, "data": None}
    runs = [
        {"precision": "bf16", "status": "ok", "log": str(log), "recipe": {"recipe": "bf16"}, "master_weight_bytes": 2**21,
         "max_saturated": None},
        {"precision": "fp8", "status": "failed", "log": str(tmp_path / "none.jsonl"), "recipe": {"recipe": "delayed"},
         "error": "RuntimeError: out of memory", "max_saturated": 0.00125, "max_flushed": 0.5},
        {"precision": "nvfp4", "status": "diverged", "log": str(tmp_path / "none.jsonl"), "recipe": {"rht": True},
         "nonfinite_steps": 2, "first_nonfinite": "blocks.0.mlp.fc", "final_train_loss": 9.5, "first_train_loss": 5.0},
    ]  # fmt: skip
    metrics = {"config": config, "env": {"torch": "2.13.0"}, "runs": runs}
    text = write_report(metrics, tmp_path, plots=False).read_text()
    assert text.startswith("# minifloat compare\n\nThe `tiny` GPT trained for 3 steps of 4×32 tokens (×2 accumulation)")
    assert "Data: the Python standard library sources on this machine." in text
    assert "Δ val and × step time are relative to `bf16`." in text and "master copy (2.00 MiB)" in text
    bf16_master = {**runs[0], "precision": "bf16@master=bf16-sr", "master_weight_bytes": 2**20}
    mixed = write_report({**metrics, "runs": [runs[0], bf16_master]}, tmp_path / "mixed", plots=False).read_text()
    assert "master copy (`bf16` 2.00 MiB, `bf16@master=bf16-sr` 1.00 MiB)" in mixed
    section = text.split("## Runs that did not finish cleanly\n\n")[1].split("\n\n")[0].splitlines()
    assert section == [
        "- **fp8: failed** — RuntimeError: out of memory",
        "- **nvfp4: diverged** — non-finite steps: 2, first non-finite layer: blocks.0.mlp.fc, "
        "final train loss 9.5 vs first 5.0",
    ]
    assert "![" not in text and not list(tmp_path.glob("*.png"))
    assert "| bf16 | — | — |" in text and "| fp8 | 1.25e-03 | 5.00e-01 |" in text
    assert '- `nvfp4`: `{"rht": true}`' in text
    assert "```json\n" + json.dumps(config, indent=2) + "\n```" in text and '"torch": "2.13.0"' in text
    # Every run clean: no such section. The default draws the plots (the loss, speed and
    # memory; no scales without telemetry) and links them.
    metrics["runs"] = runs[:1]
    metrics["config"] = dict(config, data="corpus.txt")
    text = write_report(metrics, tmp_path / "plotted").read_text()
    assert "did not finish" not in text and "Data: corpus.txt." in text
    assert "![Loss](loss.png)" in text and "![Speed and memory](speed_memory.png)" in text and "scales.png" not in text
    assert sorted(p.name for p in (tmp_path / "plotted").iterdir()) == ["loss.png", "report.md", "speed_memory.png"]
    # A plot that cannot be written (here: a folder where loss.png goes) is named, with a
    # warning; the text and the other plots are written all the same.
    (tmp_path / "blocked" / "loss.png").mkdir(parents=True)
    with pytest.warns(UserWarning, match=r"a plot was not drawn \(loss.png: MinifloatError: .* is a directory"):
        text = write_report(metrics, tmp_path / "blocked").read_text()
    assert "## Plots that were not drawn\n\n- loss.png: MinifloatError:" in text and "![Loss]" not in text
    assert "![Speed and memory](speed_memory.png)" in text and (tmp_path / "blocked" / "speed_memory.png").exists()


def test_summary_table_formats_each_figure_and_marks_missing_ones():
    from minifloat.report.comparison import summary_table

    ok = {"precision": "bf16", "status": "ok", "final_train_loss": 2.71828, "final_val_loss": 2.5,
          "val_loss_delta_pct": 0.0, "step_time_s": 0.1234, "step_time_ratio": 1.0, "tokens_per_s": 16597.3,
          "weight_bytes": 3 * 2**20 + 2**19, "peak_rss_bytes": 2**30, "skipped_steps": 0, "nonfinite_steps": 0}  # fmt: skip
    worse = dict(ok, precision="nvfp4", status="diverged", final_val_loss=float("nan"), val_loss_delta_pct=-1.234,
                 step_time_ratio=1.456, weight_bytes=2**20 // 4, skipped_steps=3, nonfinite_steps=2)  # fmt: skip
    failed = {"precision": "mxfp4", "status": "failed", "steps_completed": 0}
    table = summary_table({"runs": [ok, worse, failed]}).splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert rows[0] == ["precision", "status", "final train", "final val", "Δ val vs bf16", "step s", "× step time",
                       "tokens/s", "weights MiB", "peak RSS MiB", "skipped", "non-finite"]  # fmt: skip
    assert all(set(cell) == {"-"} for cell in rows[1])
    assert rows[2] == ["bf16", "ok", "2.7183", "2.5000", "+0.00 %", "0.123", "1.00", "16,597", "3.50", "1024.00", "0", "0"]
    assert rows[3] == ["nvfp4", "diverged", "2.7183", "nan", "-1.23 %", "0.123", "1.46", "16,597", "0.25", "1024.00", "3", "2"]
    assert rows[4] == ["mxfp4", "failed", *["—"] * 10]
    assert len({len(line) for line in table}) == 1  # columns aligned


def test_a_lora_table_shows_the_frozen_base_against_the_first_runs():
    """The ≤ 0.3× target of a packed base reads off the table: frozen parameters and buffers, and
    their ratio to the first (BF16) run's."""
    from minifloat.report.comparison import summary_table

    bf16 = {"precision": "bf16", "status": "ok", "base_val_loss": 3.0, "frozen_bytes": 256 * 2**20,
            "weight_bytes": 275 * 2**20}  # fmt: skip
    nvfp4 = dict(bf16, precision="nvfp4", frozen_bytes=72 * 2**20, weight_bytes=91 * 2**20)
    table = summary_table({"config": {"lora_rank": 16}, "runs": [bf16, nvfp4]}).splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    at = rows[0].index("frozen base MiB")
    assert rows[0][at + 1] == "× frozen base" and rows[0][at - 1] == "weights MiB"
    assert rows[2][at : at + 2] == ["256.00", "1.000"] and rows[3][at : at + 2] == ["72.00", "0.281"]
    assert "frozen base MiB" not in summary_table({"runs": [bf16, nvfp4]})  # a full fine-tune: no frozen base


def test_run_metrics_windows_are_the_last_tenth_and_all_but_the_first_tenth():
    times = [9.0, 9.0] + [1.0] * 9 + [2.0] * 9  # 20 steps: two warm-up steps, then 1 s and 2 s
    recs = [{"step": i + 1, "loss": float(i), "step_time_s": t} for i, t in enumerate(times)]
    c = dataclasses.replace(_base(), grad_accum=3)
    m = run_metrics(recs, c)
    assert m["step_time_s"] == 1.5  # the median of steps 3..20; with a warm-up step it would be 2
    assert m["final_train_loss"] == (18 + 19) / 2 and m["tokens_per_s"] == c.batch_size * c.seq_len * 3 / 1.5
    short = run_metrics(recs[:5], c)  # fewer than 10 steps: the last one, and the median after the first
    assert short["final_train_loss"] == 4.0 and short["step_time_s"] == 1.0
    one = run_metrics(recs[:1], c)
    assert one["final_train_loss"] == 0.0 and one["step_time_s"] == 9.0 and one["final_val_loss"] is None


def test_recipe_description_says_how_each_precision_computes():
    from minifloat.measure.compare import recipe_description
    from minifloat.recipes import RECIPES

    assert recipe_description("fp32") == {"recipe": "fp32", "gemm": "FP32 operands, FP32 accumulation"}
    assert recipe_description("fp16")["gemm"].startswith("FP16 operands (operands rounded to the dtype, FP32 accumulation)")
    assert recipe_description("mxfp4") == RECIPES["mxfp4"].to_dict()


def test_compare_evaluates_at_the_end_when_told_never_to_and_keeps_earlier_results_by_default(tmp_path):
    """A comparison needs a final validation loss, so --eval-every 0 becomes one evaluation
    after the last step; and compare() refuses an --out holding a report unless asked."""
    metrics = compare(["fp32"], _base(steps=2, eval_every=0), tmp_path / "run", echo=lambda s: None, plots=False)
    run = metrics["runs"][0]
    assert metrics["config"]["eval_every"] == 2 and run["status"] != "failed"
    assert [r.get("val_loss") for r in read_log(Path(run["log"]))] == [None, run["final_val_loss"]]
    assert math.isfinite(run["final_val_loss"])
    with pytest.raises(minifloat.MinifloatError, match="already holds a comparison"):
        compare(["fp32"], _base(steps=2), tmp_path / "run", echo=lambda s: None, plots=False)


def test_a_child_that_exits_cleanly_before_its_last_step_failed(tmp_path, monkeypatch):
    import minifloat.measure.compare as cmp

    monkeypatch.setattr(cmp, "_run_child", lambda cmd, echo: (0, 0, ["killed by the scheduler"]))
    run = compare(["fp32"], _base(), tmp_path, echo=lambda s: None, plots=False)["runs"][0]
    assert run["status"] == "failed" and run["error"] == "killed by the scheduler" and run["steps_completed"] == 0
    lines = [f"line {i}" for i in range(12)]  # the error keeps the last 8 lines of the child's output
    monkeypatch.setattr(cmp, "_run_child", lambda cmd, echo: (1, 0, lines))
    run = compare(["fp32"], _base(), tmp_path, echo=lambda s: None, plots=False, overwrite=True)["runs"][0]
    assert run["error"] == "\n".join(lines[4:])
    monkeypatch.setattr(cmp, "_run_child", lambda cmd, echo: (-9, 0, []))  # silent: the exit code
    run = compare(["fp32"], _base(), tmp_path, echo=lambda s: None, plots=False, overwrite=True)["runs"][0]
    assert run["error"] == "exit code -9"


def test_relative_figures_are_left_out_where_the_reference_has_none():
    from minifloat.measure.compare import _relative_to_first

    ref = {"final_val_loss": 2.0, "final_train_loss": float("nan"), "step_time_s": 0.0, "weight_bytes": 400}
    other = {"final_val_loss": 2.5, "final_train_loss": 2.0, "step_time_s": 1.0, "weight_bytes": None}
    diverged = {"final_val_loss": float("inf"), "final_train_loss": 2.0, "step_time_s": 1.0, "weight_bytes": 100}
    _relative_to_first(runs := [ref, other, diverged])
    assert [r["val_loss_delta_pct"] for r in runs] == [0.0, 25.0, None]  # inf: no figure
    assert [r["train_loss_delta_pct"] for r in runs] == [None, None, None]  # the reference's is NaN
    assert [r["step_time_ratio"] for r in runs] == [None, None, None]  # the reference's is 0
    assert [r["weight_bytes_ratio"] for r in runs] == [1.0, None, 0.25]
    _relative_to_first(runs := [dict(ref, final_train_loss=2.0), dict(other, final_train_loss=3.0)])
    assert [r["train_loss_delta_pct"] for r in runs] == [0.0, 50.0]


def test_compare_without_matplotlib_stops_before_it_trains(tmp_path, monkeypatch):
    """Plots need matplotlib: a machine without it learns so before the runs, not after them."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` finds when it is not installed
    with pytest.raises(minifloat.MinifloatError, match=r"pip install 'minifloat\[plot\]', or pass --no-plots"):
        compare(["fp32"], _base(), tmp_path / "run", echo=lambda s: None)
    assert not (tmp_path / "run").exists()


def test_within_noise_is_the_95_percent_interval_of_the_paired_mean():
    from minifloat.measure.compare import within_noise

    # mean 2, standard deviation 1, 3 seeds: the interval is 2 ± 4.303 / sqrt(3) = 2 ± 2.484
    assert within_noise([1.0, 2.0, 3.0]) is True
    assert within_noise([2.0, 3.0, 4.0]) is False  # 3 > 2.484
    assert within_noise([0.5, 0.5]) is False  # no spread: any non-zero mean is told apart
    assert within_noise([1.0]) is None and within_noise([1.0, float("nan")]) is None  # one finite Δ: no verdict


def test_figures_over_seeds_are_means_with_the_spread_of_the_paired_delta():
    from minifloat.measure.compare import _over_seeds

    per_seed = [
        {"precision": "fp8", "status": "ok", "log": "a.jsonl", "recipe": {"recipe": "delayed"}, "final_val_loss": 2.0,
         "val_loss_delta_pct": 1.0, "step_time_s": 0.5, "skipped_steps": 0, "first_nonfinite": None},
        {"precision": "fp8", "status": "diverged", "log": "b.jsonl", "recipe": {"recipe": "delayed"}, "final_val_loss": 3.0,
         "val_loss_delta_pct": 3.0, "step_time_s": 1.5, "skipped_steps": 2, "first_nonfinite": "blocks.0"},
        {"precision": "fp8", "status": "failed", "log": "c.jsonl", "recipe": {"recipe": "delayed"}, "final_val_loss": 4.0,
         "val_loss_delta_pct": 5.0, "step_time_s": 1.0, "skipped_steps": 1, "error": "RuntimeError: out of memory"},
    ]  # fmt: skip
    m = _over_seeds(per_seed, [7, 8, 9])
    assert (m["final_val_loss"], m["val_loss_delta_pct"], m["step_time_s"], m["skipped_steps"]) == (3.0, 3.0, 1.0, 1.0)
    assert m["val_loss_delta_pct_std"] == 2.0 and m["val_loss_delta_within_noise"] is True  # 3 ± 4.303 · 2 / √3 holds 0
    assert m["status"] == "failed" and m["error"] == "seed 9: RuntimeError: out of memory"
    assert m["logs"] == ["a.jsonl", "b.jsonl", "c.jsonl"] and [r["seed"] for r in m["per_seed"]] == [7, 8, 9]
    assert m["per_seed"][1]["final_val_loss"] == 3.0


def test_loss_curves_over_seeds_are_means_with_the_seeds_range(tmp_path):
    from minifloat.report.comparison import loss_curves

    def log(name, losses):
        (tmp_path / name).write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses)))
        return str(tmp_path / name)

    run = {"precision": "fp8", "status": "ok", "log": log("a", [4.0, 3.0, 2.0]), "logs": [log("a", [4.0, 3.0, 2.0]),
           log("b", [6.0, 1.0, 2.0, 9.0])]}  # fmt: skip  (b logged one step more: only the common steps count)
    (curve,) = loss_curves({"runs": [run], "config": {"seeds": [0, 1]}})
    assert curve["steps"] == [1, 2, 3] and curve["raw"] == [5.0, 2.0, 2.0]
    assert curve["band"] == ([4.0, 1.0, 2.0], [6.0, 3.0, 2.0])  # 3 steps: no smoothing (half = 0)


def test_compare_over_seeds_pairs_each_seed_with_the_reference(tmp_path):
    metrics = compare(["fp32", "fp8"], _base(steps=3, eval_every=3), tmp_path, echo=lambda s: None, plots=False, seeds=2)
    assert metrics["config"]["seeds"] == [0, 1]
    ref, fp8 = metrics["runs"]
    assert [r["seed"] for r in fp8["per_seed"]] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "runs" / "fp8").iterdir()) == ["seed0", "seed1"]
    firsts = [r["first_train_loss"] for r in ref["per_seed"]]
    assert firsts[0] != firsts[1]  # another seed: other initial weights and data
    # each seed's Δ against the reference's run of the same seed, then their mean
    deltas = [100 * (f["final_val_loss"] - r["final_val_loss"]) / r["final_val_loss"]
              for f, r in zip(fp8["per_seed"], ref["per_seed"], strict=True)]  # fmt: skip
    assert [r["val_loss_delta_pct"] for r in fp8["per_seed"]] == pytest.approx(deltas)
    assert fp8["val_loss_delta_pct"] == pytest.approx(sum(deltas) / 2)
    assert "±" in (tmp_path / "report.md").read_text()
    with pytest.raises(minifloat.MinifloatError, match="--seeds must be a whole number ≥ 1, got 0"):
        compare(["fp32"], _base(), tmp_path / "none", echo=lambda s: None, plots=False, seeds=0)
