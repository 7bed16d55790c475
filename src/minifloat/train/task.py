"""What a training run trains, on which text, with which loss: a `Task`. The loop
(`minifloat.train.loop`) owns everything else — schedule, micro-batches, loss scaling, FSDP2,
checkpoints, resume — and asks the task for the model, the batches and the loss.

`GPTTask` is the built-in GPT on a byte corpus; `minifloat.finetune` brings pretrained
transformers models (continued pretraining, SFT, LoRA).

A batch is a dict of (B, T) tensors: ``input_ids`` and ``labels`` (the next tokens; `IGNORE`
where the loss does not count), and for a model that takes them ``position_ids`` and an
``attention_mask`` (B, 1, T, T) bool. The loss is the mean cross entropy over the counted labels.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minifloat.data.corpus import Corpus, get_batch, load_corpus, stdlib_corpus
from minifloat.errors import MinifloatError
from minifloat.models.gpt import GPT, get_config
from minifloat.nn import rounded
from minifloat.nn.convert import convert
from minifloat.optim import bf16_parameters
from minifloat.recipes import RECIPES
from minifloat.train.config import TrainConfig

IGNORE = -100  # a label the loss does not count (cross_entropy's ignore_index)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of (B, T, V) logits over the counted (B, T) labels, in FP32."""
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE
    )


class Task:
    """What a run trains (see the module docstring). Subclasses fill in the model and the data."""

    name = "task"
    evaluate_before = False  # whether the run scores the model before its first step (a pretrained one)

    def prepare(self, c: TrainConfig) -> None:
        """Read the data (before the model is built: bad data fails before minutes of loading)."""

    def build_model(self, c: TrainConfig) -> torch.nn.Module:
        raise NotImplementedError

    def batch(self, c: TrainConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A training micro-batch, drawn with `generator` (whose state checkpoints keep)."""
        raise NotImplementedError

    def val_batches(self, c: TrainConfig) -> list[dict[str, torch.Tensor]]:
        """The fixed held-out batches every evaluation scores (the same for every step and precision)."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The repeated blocks (FSDP2 shards each; activation checkpointing wraps each)."""
        raise NotImplementedError

    def checkpoint_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of a state dict a checkpoint keeps (a tied weight once)."""
        return {k: v.detach().contiguous() for k, v in weights.items()}

    def load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
        """Put a checkpoint's weights into the freshly built `model` (resume)."""
        raise NotImplementedError

    def describe(self, c: TrainConfig) -> str:
        """The model in errors: "the tiny model", "the model at PATH"."""
        return "the model"

    def num_params(self, model: torch.nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    def finish(self, model: torch.nn.Module, out: Path, c: TrainConfig) -> dict:
        """After the last step (rank 0): write what the run delivers beyond its checkpoints; returns
        what the summary adds."""
        return {}


def build_gpt(c: TrainConfig) -> GPT:
    """The GPT for `c`, initialised from `c.seed`, converted to `c.precision`; its parameters in
    BF16 for a BF16 master (`c.master`)."""
    torch.manual_seed(c.seed)
    model = GPT(get_config(c.model))
    n_layer = get_config(c.model).n_layer
    high = {f"blocks.{i}." for i in range(n_layer) if i < c.high_precision_first or i >= n_layer - c.high_precision_last}

    def keep(fqn: str, m) -> bool:  # True: quantize this Linear
        return (c.quantize_head or fqn != "lm_head") and not any(fqn.startswith(h) for h in high)

    if c.precision in RECIPES:
        convert(model, c.recipe(), filter=keep)
    else:
        rounded.to_high_precision(model, c.precision, keep)
    return bf16_parameters(model) if c.master != "fp32" else model


def load_data(c: TrainConfig) -> Corpus:
    return stdlib_corpus(c.max_bytes) if c.data is None else load_corpus(c.data, c.max_bytes)


class GPTTask(Task):
    """The built-in GPT (`c.model`) from scratch on a byte corpus (`c.data`, else the stdlib sources)."""

    name = "gpt"

    def prepare(self, c: TrainConfig) -> None:
        self.config, self.data = c, load_data(c)

    def describe(self, c):
        return f"the {c.model} model"

    def build_model(self, c: TrainConfig) -> GPT:
        return build_gpt(c)

    def batch(self, c: TrainConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
        x, y = get_batch(self.data.train, c.batch_size, c.seq_len, generator)  # (B, T), (B, T)
        return {"input_ids": x, "labels": y}

    def val_batches(self, c: TrainConfig) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(10_000 + c.seed)
        out = []
        for _ in range(c.eval_batches):
            x, y = get_batch(self.data.val, c.batch_size, c.seq_len, g)
            out.append({"input_ids": x, "labels": y})
        return out

    def loss(self, model, batch):
        return cross_entropy(model(batch["input_ids"]), batch["labels"])

    def blocks(self, model):
        return list(model.blocks)

    def checkpoint_weights(self, model, weights):
        weights = dict(weights)
        weights.pop("lm_head.weight", None)  # tied to wte.weight
        return super().checkpoint_weights(model, weights)

    def load_weights(self, model, weights, path):
        missing, unexpected = model.load_state_dict(weights, strict=False)
        bad = [k for k in missing if k != "lm_head.weight" and not k.endswith(("amax_history", "scale", "amax_steps"))]
        if bad or unexpected:
            raise MinifloatError(f"{path}: weights do not fit {self.describe(self.config)} (missing {bad[:3]}, unexpected {unexpected[:3]})")
