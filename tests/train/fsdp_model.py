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
