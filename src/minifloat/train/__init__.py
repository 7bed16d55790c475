"""The main job: the built-in GPT trained on an embedded corpus in one precision, with
checkpoints that resume bit-identically (`train`), configured by a `TrainConfig`."""

from minifloat.train.config import PRECISIONS, TrainConfig
from minifloat.train.loop import build_model, train

__all__ = ["TrainConfig", "PRECISIONS", "train", "build_model"]
