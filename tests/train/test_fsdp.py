import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minifloat
from minifloat.train.config import TrainConfig
from tests.train.fsdp_model import STEPS, batch, make_model

ROOT = Path(__file__).resolve().parents[2]


def _single_process_losses(recipe):
    model = make_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["fp8"])
def test_fsdp2_two_processes_follow_the_single_process_loss_curve(tmp_path, recipe):
    out = tmp_path / "losses.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.train.fsdp_worker", str(out), recipe]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads(out.read_text())
    single = _single_process_losses(recipe)
    assert sharded[-1] < sharded[0]
    # Delayed scales are max-reduced across ranks, so after the first step both ranks quantize
    # with the single process's scales; the first step scales each shard from its own amax.
    assert sharded == pytest.approx(single, rel=2e-2)


def test_minifloat_train_fsdp_two_processes_matches_one_and_resumes_unsharded(tmp_path):
    """`torchrun --nproc_per_node 2 -m minifloat train --fsdp`: same losses as one process
    (each rank trains on its half of the same global batch), and its checkpoint (gathered
    weights, FQN-keyed optimizer state) resumes in a single process."""
    args = ["--model", "tiny", "--precision", "fp8", "--steps", "3", "--batch-size", "4", "--seq-len", "32",
            "--eval-every", "3", "--warmup", "2", "--quiet"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "minifloat", "train", "--fsdp", "--out", str(tmp_path / "fsdp"), *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"final"') == 1  # rank 0 speaks for the run
    one = subprocess.run([sys.executable, "-m", "minifloat", "train", "--out", str(tmp_path / "one"), *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]

    def log(name):
        return [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]

    sharded, single = log("fsdp"), log("one")
    assert [r["loss"] for r in sharded] == pytest.approx([r["loss"] for r in single], rel=1e-3)
    assert sharded[-1]["val_loss"] == pytest.approx(single[-1]["val_loss"], rel=1e-3)
    resumed = subprocess.run(
        [sys.executable, "-m", "minifloat", "train", "--resume", "--out", str(tmp_path / "fsdp"), *args[:5], "5", *args[6:]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in log("fsdp")] == [1, 2, 3, 4, 5]


def test_sharded_fp8_states_and_bf16_masters_resume_bit_for_bit_and_refuse_another_world(tmp_path):
    """`train --fsdp --optimizer-states fp8-dre --master bf16-sr` on 2 ranks: each rank keeps the
    states of its own shard only (half the codes of a single process's), the losses follow a
    single process's (they differ only in the stochastic rounding's bits), a 3-step run resumed to
    6 steps equals a 6-step run bit for bit (losses and the saved FP32 masters), and resuming
    with another number of processes is refused by name."""
    from minifloat import checkpoint

    def args(steps):
        return ["--model", "tiny", "--precision", "fp8", "--steps", str(steps), "--batch-size", "4", "--seq-len", "32",
                "--eval-every", "0", "--warmup", "2", "--quiet", "--optimizer-states", "fp8-dre", "--master-weights", "bf16-sr"]  # fmt: skip

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")

    def run(name, steps, *extra, fsdp=True):
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if fsdp else []
        cmd = [sys.executable, *launch, "-m", "minifloat", "train", *(["--fsdp"] if fsdp else []),
               "--out", str(tmp_path / name), *args(steps), *extra]  # fmt: skip
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    def log(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]

    def saved(name):
        return checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / name / "checkpoints"))

    for proc in (run("full", 6), run("split", 3), run("one", 6, fsdp=False)):
        assert proc.returncode == 0, proc.stderr[-3000:]
    _, _, state = saved("split")
    shards, whole = state["optimizer_shards"], saved("one")[2]["optimizer"]["state"]
    assert len(shards) == 2 and "optimizer" not in state
    codes = whole["blocks.0.mlp.fc.weight"]["exp_avg.codes"]  # (256, 64): 128 blocks of 128, 64 a rank
    key = next(k for k, v in shards[0]["state"].items() if v["exp_avg.codes"].numel() == codes.numel() // 2)
    assert all(shard["state"][key]["exp_avg.codes"].shape == (codes.shape[0] // 2, 128) for shard in shards)
    assert log("full") == pytest.approx(log("one"), rel=1e-2)

    resumed = run("split", 6, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert log("split") == log("full")
    (_, a, _), (_, b, _) = saved("split"), saved("full")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["blocks.0.mlp.fc.weight"].dtype == torch.float32

    alone = run("split", 8, "--resume", fsdp=False)
    assert alone.returncode != 0 and "sharded over FSDP ranks; resume it with --fsdp" in alone.stderr, alone.stderr[-2000:]
    assert "Traceback" not in alone.stderr


def _torchrun(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'src'}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_quantized_all_gather_sends_codes_equal_to_quantizing_after_the_gather(tmp_path, recipe):
    """torchrun, gloo, 2 processes: the Linear weights travel as codes and scales, which equal
    quantizing the full (gathered) master weight after every step; the loss curve is the plain
    all-gather's (FP8 per tensor: the same codes, so the same losses; MXFP8: its dgrad operand is
    quantized from the gathered values, a second rounding); the bytes on the wire are ≤ 0.55× a
    BF16 all-gather's (the FP32 all-gather's half), the biases (FP32) included."""
    runs = {}
    for mode in ("quantized", "plain"):
        proc = _torchrun("tests.train.fsdp_gather_worker", str(tmp_path / f"{mode}.json"), recipe, mode)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    q, plain = runs["quantized"], runs["plain"]
    assert len(q["exact"]) == 2 * STEPS and all(q["exact"])
    if recipe == "fp8-current":
        assert q["losses"] == plain["losses"]
    else:
        assert q["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert len(q["sent"]) == len(plain["sent"])  # the same all-gathers, fewer bytes each
    ratio = sum(q["sent"]) / (sum(plain["sent"]) / 2)
    assert ratio <= 0.55, ratio


def test_minifloat_train_fp8_all_gather_follows_the_plain_gather(tmp_path):
    """`train --fsdp --fp8-all-gather`: the mxfp8 run's losses follow the plain all-gather's."""
    args = ["--model", "tiny", "--precision", "mxfp8", "--steps", "3", "--batch-size", "4", "--seq-len", "32",
            "--eval-every", "3", "--warmup", "2", "--quiet", "--fsdp"]  # fmt: skip
    logs = {}
    for name, extra in (("gather", ["--fp8-all-gather"]), ("plain", [])):
        proc = _torchrun("minifloat", "train", "--out", str(tmp_path / name), *args, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[name] = [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logs["gather"]] == pytest.approx([r["loss"] for r in logs["plain"]], rel=1e-3)
    with pytest.raises(minifloat.MinifloatError, match="--fp8-all-gather .* needs --fsdp and a precision"):
        TrainConfig(precision="fp8", fsdp=True, fp8_all_gather=True)


def test_a_wrapped_weight_is_its_value_under_every_op():
    """In one process: the sharded master wrapper acts as its float weight (what the optimizer and
    checkpoints see), the gathered one as its dequantized codes; other schemes are refused by name."""
    from minifloat.nn.all_gather import GatheredWeight, QuantizedGatherWeight, gather_quantized

    t = torch.randn(64, 96)
    w = QuantizedGatherWeight(t.clone(), minifloat.get_scheme("mxfp8"))
    assert type(w.view(64, 96)) is QuantizedGatherWeight and type(w * 2) is torch.Tensor and torch.equal(w * 2, t * 2)
    w.add_(1.0)
    assert torch.equal(w * 1, t + 1.0)
    q = minifloat.quantize(t, "mxfp8")
    g = GatheredWeight(q.data, q.scale, q.scheme, torch.float32)
    assert torch.equal(g + 0, q.dequantize()) and g.quantized().data is q.data
    with pytest.raises(minifloat.MinifloatError, match="the nvfp4 weight cannot be all-gathered quantized"):
        QuantizedGatherWeight(t, minifloat.get_scheme("nvfp4"))
    with pytest.raises(minifloat.MinifloatError, match="in_features a multiple of 32"):
        gather_quantized(minifloat.convert(torch.nn.Sequential(torch.nn.Linear(48, 32)), "mxfp8"))
    rotated = minifloat.recipes.MXScaling(element="e4m3", forward_rht=True)  # its forward quantizes the rotated weight
    with pytest.raises(minifloat.MinifloatError, match="forward_rht recipe quantizes the rotated weight"):
        gather_quantized(minifloat.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)), rotated))
    split = minifloat.get_recipe("mxfp8").replace(outlier_channels=4)  # its forward multiplies 4 channels of the BF16 weight
    with pytest.raises(minifloat.MinifloatError, match="recipe with outlier_channels multiplies those channels"):
        gather_quantized(minifloat.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)), split))
