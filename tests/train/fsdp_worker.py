"""Run by test_fsdp.py under `torchrun --nproc_per_node 2`: FSDP2 training of a converted
model on CPU (gloo); rank 0 writes the global loss per step as JSON to argv[1]."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.train.fsdp_model import STEPS, make_model, sharded_step


def main(out: str, recipe: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(recipe)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        losses.append(sharded_step(model, opt, step, rank, world))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)
    # Under load, about one run in 25 died of "terminate called without an active exception"
    # (SIGABRT) after training: gloo threads still holding work objects while the interpreter
    # tears down (pytorch/pytorch#179291). So: every rank done, FSDP's state freed, the group
    # destroyed, and no interpreter teardown at all.
    del model, opt
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
