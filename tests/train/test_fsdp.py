import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
