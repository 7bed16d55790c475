"""The jobs behind `minifloat quantize` and `minifloat eval`, for library users too.

Text for calibration and evaluation comes from a corpus (`minifloat.train.corpus`: the Python
standard library's sources by default, or ``--data`` / ``--calib``): calibration windows from its
training split, evaluation windows from its held-out split, so that a model is never scored on
the text its scales were fitted to. Token ids are bytes (the built-in GPT's vocabulary) unless
the model folder has a tokenizer.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.config import QuantConfig, get_quant_config
from minifloat.infer.export import FORMATS, export
from minifloat.infer.method import PTQMethod, resolve_method
from minifloat.infer.metrics import evaluate, token_batches
from minifloat.infer.models import gpt_to_transformers, is_transformers, load_model
from minifloat.infer.ptq import QuantizeSummary, calibrate, quantize_model
from minifloat.train.corpus import Corpus, load_corpus, stdlib_corpus
from minifloat.train.model import GPT


@dataclasses.dataclass(frozen=True)
class TextSource:
    """Where evaluation and calibration text comes from, and how it becomes token ids."""

    data: str | None = None  # a text file or folder; None: the Python stdlib sources
    calib: str | None = None  # text to calibrate on (its training split); None: `data`'s training split
    max_bytes: int = 4_000_000
    batch_size: int = 8
    seq_len: int = 128
    eval_batches: int = 16
    calib_batches: int = 8

    def corpus(self, split: str = "val") -> Corpus:
        """The corpus a split's windows come from: `calib` for calibration (``"train"``) if given."""
        data = self.calib if split == "train" and self.calib is not None else self.data
        return stdlib_corpus(self.max_bytes) if data is None else load_corpus(data, self.max_bytes)


def tokenizer_for(path: str | os.PathLike[str] | None):
    """The transformers tokenizer saved in the model folder `path` or held by the GGUF file
    `path`, or None (byte tokens)."""
    if path is not None and Path(path).is_file() and Path(path).suffix.lower() == ".gguf":
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(Path(path).parent, gguf_file=Path(path).name)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise MinifloatError(f"{path}: its tokenizer could not be read ({type(err).__name__}: {err})") from None
    if path is None or not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer  # a tokenizer file says transformers wrote the folder

    return AutoTokenizer.from_pretrained(path)


def _check_vocab(model: torch.nn.Module, tokenizer) -> None:
    vocab = getattr(model.config, "vocab_size", None)
    if tokenizer is not None:
        if vocab is not None and len(tokenizer) > vocab:
            raise MinifloatError(f"the tokenizer has {len(tokenizer):,} tokens and the model's vocabulary {vocab:,}: "
                                 f"they do not belong together (token ids past {vocab - 1} have no embedding)")  # fmt: skip
        return
    if vocab < 256:
        raise MinifloatError(f"the model's vocabulary has {vocab} tokens and its folder no tokenizer: byte tokens need ≥ 256")


def batches_for(model: torch.nn.Module, source: TextSource, split: str, tokenizer=None) -> list[torch.Tensor]:
    """Evaluation (``split="val"``) or calibration (``"train"``) batches of the model's context."""
    _check_vocab(model, tokenizer)
    corpus = source.corpus(split)
    text = bytes(corpus.val.numpy()) if split == "val" else bytes(corpus.train.numpy())
    context = getattr(model.config, "block_size", None) or getattr(model.config, "max_position_embeddings", None)
    seq_len = min(source.seq_len, context - 1) if context else source.seq_len
    n = source.eval_batches if split == "val" else source.calib_batches
    what = "evaluation text (held-out split)" if split == "val" else "calibration text (training split)"
    return token_batches(text, batch_size=source.batch_size, seq_len=seq_len, n_batches=n, tokenizer=tokenizer, what=what,
                         disjoint=split == "train")


def servable(model: torch.nn.Module) -> torch.nn.Module:
    """The model as serving checkpoints hold it: the built-in GPT as transformers' OPT."""
    return gpt_to_transformers(model) if isinstance(model, GPT) else model


def quantize_checkpoint(
    model_path: str | os.PathLike[str],
    config: str | QuantConfig,
    out: str | os.PathLike[str],
    *,
    format: str = "compressed-tensors",
    source: TextSource = TextSource(),  # noqa: B008 - frozen
    overwrite: bool = False,
    ignore: tuple[str, ...] = ("lm_head",),
    quantize_head: bool = False,
    method: str | PTQMethod = "rtn",
) -> QuantizeSummary:
    """Load `model_path`, quantize it with `config` by `method` (calibrating on `source`'s training
    split when the config or the method needs it; the LM head and embedding too with
    `quantize_head`) and export it to `out` in `format`; a layer that format's readers could not
    load stays in high precision, ``method="gptq"`` leaves the recommended rotation out, and
    smoothing is only folded into norms (never online). What
    can fail is checked first: the config, the method, the format, the output folder."""
    config = get_quant_config(config)
    method = resolve_method(method, config, export=True)
    if method.rotation is not None:
        raise MinifloatError(f"rotation {method.rotation}: a rotated weight means W·T, and no {format} reader applies "
                             f"minifloat's online Hadamard transform on load, so such a checkpoint would load wrong; "
                             f"quantize without --rotate to export (rotations are for eval / generate in memory)")  # fmt: skip
    if format not in FORMATS:
        raise MinifloatError(f"unknown format {format!r}; use one of {', '.join(FORMATS)}")
    if format == "hf-fp8" and config.name != "fp8-block":
        raise MinifloatError(f"format 'hf-fp8' holds fp8-block weights; --scheme {config.name} needs compressed-tensors")
    if Path(out).exists() and not overwrite:
        raise MinifloatError(f"{out} exists; pass --overwrite to replace it, or choose another folder")
    model = servable(load_model(model_path))
    if not is_transformers(model):  # pragma: no cover - load_model returns one of the two
        raise MinifloatError(f"{model_path}: not a model minifloat can export")
    tokenizer = tokenizer_for(model_path)
    calibration = _calibration(model, config, method, source, tokenizer)
    summary = quantize_model(model, config, calibration=calibration, ignore=ignore, export_format=format,
                             quantize_head=quantize_head, method=method)  # fmt: skip
    if not summary.quantized:
        raise MinifloatError(f"no layer of {model_path} could be quantized with {config.name}:\n{summary}")
    export(model, out, format=format, overwrite=overwrite, tokenizer_dir=model_path if tokenizer else None)
    return summary


def _calibration(model, config: QuantConfig, method: PTQMethod, source: TextSource, tokenizer):
    """Calibration batches when `method` calibrates layer by layer, amaxes when only the config's
    input scale needs them, else None."""
    if method.sequential:
        return batches_for(model, source, "train", tokenizer)
    return calibrate(model, batches_for(model, source, "train", tokenizer)) if config.needs_calibration else None


def quantize_in_memory(model: torch.nn.Module, scheme: str | QuantConfig, tokenizer=None, *,
                       source: TextSource = TextSource(), quantize_head: bool = False,  # noqa: B008 - frozen
                       method: str | PTQMethod = "rtn") -> QuantizeSummary:  # fmt: skip
    """Quantize `model` in place with `scheme` by `method` (the LM head and embedding too with
    `quantize_head`), calibrating on `source`'s training split when the config or method needs it."""
    config = get_quant_config(scheme)
    method = resolve_method(method, config)
    cal = _calibration(model, config, method, source, tokenizer)
    return quantize_model(model, config, calibration=cal, quantize_head=quantize_head, method=method)


def evaluate_paths(
    model_path: str | os.PathLike[str],
    reference_path: str | os.PathLike[str] | None = None,
    *,
    scheme: str | QuantConfig | None = None,
    source: TextSource = TextSource(),  # noqa: B008 - frozen
    quantize_head: bool = False,
    method: str | PTQMethod = "rtn",
) -> dict:
    """`evaluate` the model at `model_path` on `source`'s held-out split against the one at
    `reference_path`; with `scheme`, quantize it first (by `method`), and compare with itself
    unquantized when no reference is given."""
    model = load_model(model_path)  # the built-in GPT as it is: evaluation needs no transformers
    reference = load_model(reference_path) if reference_path else None
    tokenizer = tokenizer_for(model_path)
    if scheme is not None:
        method = resolve_method(method, get_quant_config(scheme))  # an unknown name: an error before the copy
        reference = reference if reference is not None else copy.deepcopy(model)
        quantize_in_memory(model, scheme, tokenizer, source=source, quantize_head=quantize_head, method=method)
    return evaluate(model, reference, batches_for(model, source, "val", tokenizer))
