import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fsdp_model import STEPS, batch, make_model

ROOT = Path(__file__).resolve().parent.parent


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
           "-m", "tests.fsdp_worker", str(out), recipe]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads(out.read_text())
    single = _single_process_losses(recipe)
    assert sharded[-1] < sharded[0]
    # Delayed scales are max-reduced across ranks, so after the first step both ranks quantize
    # with the single process's scales; the first step scales each shard from its own amax.
    assert sharded == pytest.approx(single, rel=2e-2)
