"""Distributed set-up for ``train(fsdp=True)`` under torchrun: a gloo process group, FSDP2
sharding of the GPT, and the state-dict options that gather full weights for checkpoints."""

from __future__ import annotations

import os

import torch

from minifloat.errors import MinifloatError
from minifloat.train.config import TrainConfig


def mean_over_ranks(value: float, world: int) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / world


def init_distributed(c: TrainConfig) -> tuple[int, int, bool]:
    """(rank, world size, whether we created the process group): (0, 1, False) without
    ``fsdp``; under torchrun, a gloo process group unless the caller already made one."""
    if not c.fsdp:
        return 0, 1, False
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        raise MinifloatError(
            "--fsdp runs under torchrun, e.g.: torchrun --nproc_per_node 2 -m minifloat train --fsdp ..."
        )
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if c.batch_size % world:
        raise MinifloatError(f"--batch-size {c.batch_size} must be a multiple of the {world} FSDP ranks")
    return rank, world, created


def shard(model: torch.nn.Module, blocks: list[torch.nn.Module], world: int, quantized_gather: bool = False) -> None:
    """FSDP2: shard each of the model's `blocks`, then the rest (embeddings, tied head) at the root;
    `quantized_gather`: the quantized Linears' weights travel as codes and scales
    (`minifloat.nn.all_gather`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from minifloat.nn.all_gather import gather_quantized

    if quantized_gather:
        gather_quantized(model)
    mesh = init_device_mesh("cpu", (world,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def state_options(c: TrainConfig):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=c.fsdp)
