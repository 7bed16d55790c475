"""Run by test_fsdp.py under `torchrun --nproc_per_node 2`: FSDP2 training with the Linear weights
all-gathered as codes and scales (argv[3] == "quantized") or as stored ("plain"). Rank 0 writes
JSON to argv[1]: the loss per step, the bytes each all-gather sent from this rank, the
gathered weights' numel, and whether every gathered weight's codes and scales equal quantizing
the full weight (the sharded masters gathered as values, then quantized)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import minifloat
from minifloat.nn.all_gather import GatheredWeight, gather_quantized
from tests.train.fsdp_model import STEPS, make_model, sharded_step


def main(out: str, recipe: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sent, counting_on = [], [True]
    real = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    name = real.__name__

    def counting(output_tensor, input_tensor, *args, **kwargs):
        if counting_on[0]:
            sent.append(input_tensor.numel() * input_tensor.element_size())
        return real(output_tensor, input_tensor, *args, **kwargs)

    setattr(dist, name, counting)
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(recipe)
    linears = [m for m in model if isinstance(m, minifloat.nn.Linear)]
    if mode == "quantized":
        assert gather_quantized(model) == len(linears)
    for layer in linears:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, exact = [], []
    for step in range(STEPS):
        losses.append(sharded_step(model, opt, step, rank, world))
        counting_on[0] = False
        if mode == "quantized":  # after the update: gather the masters' values, then the codes as the forward gets them
            full = [layer.weight.full_tensor() for layer in linears]
            for layer, w in zip(linears, full, strict=True):
                layer.unshard()
                g = layer.weight
                want = minifloat.quantize(w, layer.recipe.scheme("weight"))
                got = g.quantized() if isinstance(g, GatheredWeight) else None
                exact.append(got is not None and torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale))
                layer.reshard()
        counting_on[0] = True
    sizes = {str(i): list(m.weight.shape) for i, m in enumerate(linears)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "sent": sent, "exact": exact, "sizes": sizes,
                       "gathered_numel": sum(m.weight.numel() for m in linears)}, f)  # fmt: skip
    del model, opt
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
