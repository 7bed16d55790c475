"""`quantize --format gguf --budget-bits`: layers kept out of FP4 until the file's tensors hold the
budget, chosen by the knapsack over Fisher estimates — checked against the file's own tensor
sizes (read with `gguf`), ggml's block sizes, and a brute force over every kept set."""

import itertools
import json

import pytest

from minifloat.cli import main
from minifloat.errors import MinifloatError
from minifloat.measure.llamacpp import _spec

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SMALL = ["--calib-batches", "2", "--batch-size", "2", "--seq-len", "32"]
Q8_0, NVFP4 = 34 * 8 / 32, 36 * 8 / 64  # bits per value of ggml's blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.infer.test_gguf_and_bad_inputs import write_tiny_gguf

    path = tmp_path_factory.mktemp("keep") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def _file(path):
    """(tensor bits per weight, {tensor: ggml type}) counted from the file."""
    tensors = gguf.GGUFReader(path).tensors
    bits = sum(8 * int(t.n_bytes) for t in tensors)
    values = sum(int(t.n_elements) for t in tensors if not t.name.endswith(".scale"))
    return bits / values, values, {t.name: t.tensor_type.name for t in tensors}


def _quantize(tiny, out, capsys, *extra):
    capsys.readouterr()
    rc = main(["quantize", str(tiny), "--scheme", "nvfp4-weight-only", "--format", "gguf", "--out", str(out), "--json",
               *SMALL, *extra])  # fmt: skip
    return rc, capsys.readouterr()


def test_the_file_holds_the_budget_keeping_the_least_loss_a_brute_force_finds(tiny, tmp_path, capsys):
    rc, _ = _quantize(tiny, tmp_path / "all.gguf", capsys)
    assert rc == 0
    floor, values, _ = _file(tmp_path / "all.gguf")
    budget = floor + 1.0
    rc, out = _quantize(tiny, tmp_path / "b.gguf", capsys, "--budget-bits", f"{budget}")
    assert rc == 0, out.err
    plan = json.loads(out.out)["budget"]
    bits, _, types = _file(tmp_path / "b.gguf")
    assert floor < bits <= budget and bits == pytest.approx(plan["tensor_bits_per_weight"])
    kept = set(plan["keep"])
    layers = {r["name"]: r["shape"] for r in json.loads(out.out)["layers"] if r["name"] != "lm_head"}
    assert 0 < len(kept) < len(layers)  # a choice was made
    for name in layers:
        block, proj = name.split(".")[2], name.rsplit(".", 1)[1]
        g = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
             "up_proj": "ffn_up", "down_proj": "ffn_down"}[proj]  # fmt: skip
        assert types[f"blk.{block}.{g}.weight"] == ("Q8_0" if name in kept else "NVFP4"), name
    # every kept set within the budget (costs from ggml's block sizes, not the code's): none leaves less estimated loss
    extra = {n: (Q8_0 - NVFP4) * n_ * k_ - 32 for n, (n_, k_) in layers.items()}  # kept: no .scale tensor either
    est = plan["estimate"]
    room = (budget - floor) * values
    best = min(sum(est[n] for n in layers if n not in subset)
               for r in range(len(layers) + 1) for subset in itertools.combinations(layers, r)
               if sum(extra[n] for n in subset) <= room - 256 * (len(layers) + 1))  # the planner's cost rounding  # fmt: skip
    mine = sum(est[n] for n in layers if n not in kept)
    assert sum(extra[n] for n in kept) <= room and mine <= best + 1e-12


def test_a_budget_the_file_cannot_meet_or_a_format_without_one_is_refused_first(tiny, tmp_path, capsys):
    rc, out = _quantize(tiny, tmp_path / "x.gguf", capsys, "--budget-bits", "3")
    assert rc == 2 and "ask at least that" in out.err and "--budget-bits 3" in out.err and not (tmp_path / "x.gguf").exists()
    capsys.readouterr()
    assert main(["quantize", str(tiny), "--scheme", "nvfp4-weight-only", "--out", str(tmp_path / "ct"), "--budget-bits",
                 "6", *SMALL]) == 2  # fmt: skip
    assert "add --format gguf" in capsys.readouterr().err and not (tmp_path / "ct").exists()
    rc, out = _quantize(tiny, tmp_path / "n.gguf", capsys, "--budget-bits", "nan")
    assert rc == 2 and "positive number of bits" in out.err


def test_bench_llamacpp_configs_name_kept_layers_and_a_budget():
    assert _spec("nvfp4-weight-only:*.down_proj;*.v_proj@6.1") == ("nvfp4-weight-only", ("*.down_proj", "*.v_proj"), 6.1)
    assert _spec("mxfp4-weight-only") == ("mxfp4-weight-only", (), None)
    with pytest.raises(MinifloatError, match="bits per weight, e.g. nvfp4-weight-only@6.1"):
        _spec("nvfp4-weight-only@six")
