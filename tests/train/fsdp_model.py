"""The model and data shared by the FSDP2 test and its worker."""

import torch

import minifloat

STEPS = 6


def make_model(recipe: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    return minifloat.convert(model, recipe)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(64, 64, generator=g)
    return x, torch.tanh(x * 0.5)


def sharded_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    """One optimizer step of a sharded `model` on this rank's rows of `batch(step)`; the global mean loss."""
    import torch.distributed as dist

    x, y = batch(step)
    per = x.shape[0] // world
    loss = torch.nn.functional.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world
