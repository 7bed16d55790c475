"""`minifloat validate` (every example at a tiny size; a broken quantizer fails it; traces parse)
and the `minifloat memory` planner (the documents' 7B figures, hand counts, a real training state)."""

import json

import pytest

import minifloat
from minifloat.cli import main
from minifloat.models.gpt import GPT, get_config
from minifloat.planner.memory import measured_state, parse_params, plan
from minifloat.validate import runner


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    out = tmp_path_factory.mktemp("validate")
    code = main(["validate", "--profile-all", "--size", "tiny", "--reps", "1", "--out", str(out), "--no-plots"])
    return code, out


def test_every_example_runs_and_passes_at_a_tiny_size(validated):
    code, out = validated
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["name"] for e in metrics["examples"]] == list(runner.EXAMPLES)
    failed = [(e["name"], c["name"], c["detail"]) for e in metrics["examples"] for c in e["checks"] if not c["passed"]]
    assert code == 0 and not failed and metrics["passed"]
    for e in metrics["examples"]:
        assert e["checks"] and e["rows"] and e["wall_s"] > 0 and e["memory"]["peak_rss"] > 0
    report = (out / "report.md").read_text()
    assert report.index("## Failures") < report.index("## Summary") < report.index("## Speed-up analysis") < report.index("## Environment")
    gemm = next(e for e in metrics["examples"] if e["name"] == "gemm")
    assert {r["precision"] for r in gemm["rows"]} >= {"fp32", "bf16", "fp16", "fp8 tensor", "fp8 row", "fp8 block", "mxfp8",
                                                      "mxfp6", "mxfp4", "nvfp4"}  # fmt: skip


def test_traces_are_chrome_json_with_the_phase_ranges(validated):
    _, out = validated
    for name in runner.EXAMPLES:
        trace = json.loads((out / "profiler_output" / f"{name}.json").read_text())
        names = {ev.get("name") for ev in trace["traceEvents"]}
        assert any(n and n.startswith(f"{name}/") for n in names), name
    gemm = {ev.get("name") for ev in json.loads((out / "profiler_output" / "gemm.json").read_text())["traceEvents"]}
    assert {"gemm", "quantize", "dequantize", "gemm/nvfp4"} <= gemm


def test_a_broken_quantizer_fails_validate(tmp_path, monkeypatch):
    from minifloat.validate.examples import quantize as example

    real = example.quantize

    def broken(x, scheme, **kw):  # one element in 8 moved by a large step: what an off-by-one-code bug does
        noisy = x.clone()
        noisy.view(-1)[::8] *= 1.5
        return real(noisy, scheme, **kw)

    monkeypatch.setattr(example, "quantize", broken)
    out = tmp_path / "v"
    assert main(["validate", "--example", "quantize", "--size", "tiny", "--reps", "1", "--out", str(out), "--no-plots"]) == 1
    report = (out / "report.md").read_text()
    failures = report[report.index("## Failures") : report.index("## Summary")]
    assert "**quantize**" in failures and "SQNR" in failures
    # the report is rendered again from metrics.json alone, and the exit status still says it failed
    (out / "report.md").unlink()
    assert main(["validate", "--generate-report", str(out), "--no-plots"]) == 1 and (out / "report.md").is_file()


def test_validate_command_errors_and_list(tmp_path, capsys):
    assert main(["validate", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in runner.EXAMPLES)
    assert main(["validate", "--example", "nope", "--out", str(tmp_path)]) == 2
    assert main(["validate", "--generate-report", str(tmp_path / "missing")]) == 2


# --- the memory planner -------------------------------------------------------------------------


def test_the_documents_7b_example():
    n, key = parse_params("7B")
    assert n == 7_000_000_000 and key == "7b"
    fp32 = plan(params=n, precision="fp32")
    fp8 = plan(params=n, precision="fp8", master="fp32")
    # hand counts: FP32 4 + 4 + 8 bytes a parameter; FP8 1 + 1 (two copies) + 4 master + 2 BF16 grads + 4 FP32 accumulator + 8
    assert fp32.total_state() == 16 * n == 112e9
    assert fp8.total_state() == 20 * n == 140e9
    assert fp8.total_state(device_only=True, offload=("master", "optimizer")) == 4 * n == 28e9
    half = plan(params=n, precision="fp8", world_size=2)
    assert half.total_state() == 70e9


def test_activations_by_hand_and_formats():
    # Korthikanti et al.: 34·s·b·h bytes a layer at 16 bits (flash attention); FP8 Linear inputs: 34 − 14 + 7
    p = plan(params=10**6, precision="bf16", hidden=1024, layers=2, heads=16, batch=2, seq=512)
    assert p.rows["activations"] == 34 * 512 * 2 * 1024 * 2
    p = plan(params=10**6, precision="fp8", hidden=1024, layers=2, heads=16, batch=2, seq=512)
    assert p.rows["activations"] == 27 * 512 * 2 * 1024 * 2
    p = plan(params=10**6, precision="bf16", hidden=1024, layers=2, heads=16, batch=2, seq=512, flash=False)
    assert p.rows["activations"] == (34 + 5 * 16 * 512 / 1024) * 512 * 2 * 1024 * 2
    assert "not counted" in plan(params=10**6).assumptions["activations"]


@pytest.mark.parametrize("precision", ["fp32", "fp8", "nvfp4"])
def test_the_planner_matches_a_real_training_state(precision):
    c = get_config("tiny")
    # the tiny GPT by hand: embeddings, positions, 2 blocks (4 Linears with biases, 2 LayerNorms), the final LayerNorm
    h = c.n_embd
    block = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    n = c.vocab_size * h + c.block_size * h + c.n_layer * block + 2 * h
    assert n == GPT(c).num_params()
    m = measured_state("tiny", precision, batch=2, seq=64)
    p = plan(params=n, precision=precision, layout="minifloat", hidden=h, layers=c.n_layer, heads=c.n_head,
             vocab=c.vocab_size, batch=2, seq=64)  # fmt: skip
    for k in ("parameters", "gradients", "optimizer states"):
        assert m[k] == p.rows[k]
    assert m["activations"] == pytest.approx(p.rows["activations"], rel=0.1)
    if precision != "fp32":
        assert m["weight copies"] == pytest.approx(p.rows["weight copies"], rel=1e-3)


@pytest.mark.parametrize("master", ["bf16-sr", "bf16+remainder"])
def test_bf16_masters_in_the_plan_match_a_real_training_state(master):
    """BF16 parameters and gradients (2 bytes each), the remainder (2 bytes) where it keeps the
    FP32 master, FP8 (COAT) moments: fp8-dre with bf16-sr trains in ≤ 8 bytes a parameter."""
    c = get_config("tiny")
    m = measured_state("tiny", "fp8", batch=2, seq=64, optimizer_states="fp8-dre", master=master)
    n = m["num_params"]
    p = plan(params=n, precision="fp8", layout="minifloat", master=master, optimizer_states="fp8-dre", hidden=c.n_embd,
             layers=c.n_layer, heads=c.n_head, vocab=c.vocab_size, batch=2, seq=64)  # fmt: skip
    for k in ("parameters", "gradients", "master weights"):
        assert m[k] == p.rows[k], k
    # each parameter's moments padded to whole blocks of 128: a little above the plan's count
    assert p.rows["optimizer states"] <= m["optimizer states"] <= 1.02 * p.rows["optimizer states"]
    assert m["parameters"] == m["gradients"] == 2 * n and m["master weights"] == (2 * n if master == "bf16+remainder" else 0)
    assert m["activations"] == pytest.approx(p.rows["activations"], rel=0.06)  # FP32 activations: the casts keep them FP32
    state = sum(m[k] for k in ("parameters", "gradients", "master weights", "optimizer states")) / n
    assert state <= (8 if master == "bf16-sr" else 8.25)
    te = plan(params=7e9, precision="fp8", layout="te", master=master)
    assert te.rows["master weights"] == (2 if master == "bf16-sr" else 4) * 7e9
    with pytest.raises(minifloat.MinifloatError, match="--master bf16-sr keeps BF16 weights"):
        plan(params=10, precision="fp32", master="bf16-sr")


def test_fp8_all_gather_halves_the_gathered_weights():
    """A 7B (Llama shape, h = 4096) over 8 devices: one layer's 12·h² weights unsharded at a time,
    BF16 (2 bytes) against FP8 codes (1) or MXFP8 codes and scales (1 + 1/32)."""
    kw = dict(params=7e9, layout="te", world_size=8, hidden=4096, layers=32)
    bf16 = plan(precision="fp8", **kw).rows["all-gather buffer"]
    assert bf16 == 12 * 4096**2 * 2
    assert plan(precision="fp8", fp8_all_gather=True, **kw).rows["all-gather buffer"] == bf16 / 2
    assert plan(precision="mxfp8", fp8_all_gather=True, **kw).rows["all-gather buffer"] == bf16 / 2 * (1 + 1 / 32)
    assert "all-gather buffer" not in plan(params=7e9, precision="fp8").rows  # one device gathers nothing
    with pytest.raises(minifloat.MinifloatError, match="needs --world-size ≥ 2 and --precision fp8 or mxfp8, got 8 and nvfp4"):
        plan(precision="nvfp4", fp8_all_gather=True, **kw)


def test_memory_command(capsys):
    assert main(["memory", "--params", "7B", "--precision", "fp8", "--offload", "master,optimizer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["category"]: r for r in out["rows"]}
    assert rows["states on the device (all but activations)"]["bytes"] == 28e9 and rows["master weights"]["where"] == "host"
    assert main(["memory", "--model", "tiny", "--precision", "fp8", "--seq", "64", "--batch", "2", "--measure"]) == 0
    assert "measured / planned" in capsys.readouterr().out
    for fmt, per_param in (("bf16", 4.0), ("fp8", 2 * (1 + 4 / 128)), ("fp8-dre", 2 * (1 + 12 / 128))):
        assert main(["memory", "--model", "tiny", "--precision", "fp8", "--seq", "64", "--batch", "2", "--optimizer-states", fmt,
                     "--measure", "--json"]) == 0  # fmt: skip
        out = json.loads(capsys.readouterr().out)
        states = out["measured"]["optimizer states"]  # every parameter's moments, padded to whole blocks each
        assert states["planned"] == pytest.approx(per_param * out["params"], rel=1e-3)
        assert states["measured"] == pytest.approx(states["planned"], rel=2e-2) and states["measured"] >= states["planned"]
    assert main(["memory", "--params", "7B", "--optimizer", "sgd", "--optimizer-states", "fp8"]) == 2
    assert main(["memory", "--params", "seven"]) == 2
    assert main(["memory", "--params", "7B", "--offload", "gpu"]) == 2
