"""The jobs behind `minifloat quantize` and `minifloat eval`, for library users too.

Text for calibration and evaluation comes from a corpus (`minifloat.data.corpus`: the Python
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

from minifloat.data.text import TextSource, batches_for, text_conventions, tokenizer_for
from minifloat.errors import MinifloatError
from minifloat.infer.checkpoints import gguf_file, hf_fp8
from minifloat.infer.checkpoints.export import EXPORT_FORMATS, export
from minifloat.infer.checkpoints.loaders import load_model
from minifloat.infer.evaluation.metrics import evaluate
from minifloat.infer.ptq.config import QuantConfig, get_quant_config
from minifloat.infer.ptq.method import PTQMethod, resolve_method
from minifloat.infer.quantize import QuantizeSummary, calibrate, quantize_model
from minifloat.models.gpt import GPT
from minifloat.models.loading import is_transformers
from minifloat.models.opt import gpt_to_transformers


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
    gguf_rest: str = "q8_0",
) -> QuantizeSummary:
    """Load `model_path`, quantize it with `config` by `method` (calibrating on `source`'s training
    split when the config or the method needs it; the LM head and embedding too with
    `quantize_head`) and export it to `out` in `format`; a layer that format's readers could not
    load stays in high precision, ``method="gptq"`` leaves the recommended rotation and kept
    channels out, and
    smoothing is only folded into norms (never online). What
    can fail is checked first: the config, the method, the format, the output folder."""
    config = get_quant_config(config)
    method = resolve_method(method, config, export=True)
    if method.rotation is not None:
        raise MinifloatError(f"rotation {method.rotation}: a rotated weight means W·T, and no {format} reader applies "
                             f"minifloat's online Hadamard transform on load, so such a checkpoint would load wrong; "
                             f"quantize without --rotate to export (rotations are for eval / generate in memory)")  # fmt: skip
    if method.keep_channels:
        raise MinifloatError(f"keep_channels {method.keep_channels}: no {format} reader multiplies input channels kept "
                             f"beside the quantized weight, so such a checkpoint would load wrong; quantize without "
                             f"--keep-channels to export (kept channels are for eval / generate in memory)")  # fmt: skip
    if format not in EXPORT_FORMATS:
        raise MinifloatError(f"unknown format {format!r}; use one of {', '.join(EXPORT_FORMATS)}")
    if format == gguf_file.NAME:
        gguf_file.check_request(model_path, config, gguf_rest)
    if format == "hf-fp8" and not hf_fp8.holds(config):
        raise MinifloatError(f"format 'hf-fp8' holds fp8-block weights; --scheme {config.name} needs compressed-tensors")
    if Path(out).exists() and not overwrite:
        raise MinifloatError(f"{out} exists; pass --overwrite to replace it, or choose another folder")
    model = servable(load_model(model_path))
    if not is_transformers(model):  # pragma: no cover - load_model returns one of the two
        raise MinifloatError(f"{model_path}: not a model minifloat can export")
    tokenizer = tokenizer_for(model_path)
    calibration = _calibration(model, config, method, source, tokenizer)
    summary = quantize_model(model, config, calibration=calibration, ignore=ignore, export_format=format,
                             quantize_head=quantize_head, method=method,
                             tuning=tuning_batches(model, method, source, tokenizer))  # fmt: skip
    if not summary.quantized:
        raise MinifloatError(f"no layer of {model_path} could be quantized with {config.name}:\n{summary}")
    export(model, out, format=format, overwrite=overwrite, tokenizer_dir=model_path if tokenizer else None,
           gguf_source=model_path, gguf_rest=gguf_rest)
    return summary


def _calibration(model, config: QuantConfig, method: PTQMethod, source: TextSource, tokenizer):
    """Calibration batches when `method` calibrates layer by layer, amaxes when only the config's
    input scale needs them, else None."""
    if method.sequential:
        return batches_for(model, source, "train", tokenizer)
    return calibrate(model, batches_for(model, source, "train", tokenizer)) if config.needs_calibration else None


def tuning_batches(model, method: PTQMethod, source: TextSource, tokenizer) -> list[torch.Tensor] | None:
    """The windows norm tuning distills on (None without it): one batch of its `rows` windows a
    step from `source`'s training split (evenly spaced, so most are not the calibration windows),
    as many as the split holds up to one a step; the steps cycle over them."""
    tuning = method.norm_tuning
    if tuning is None:
        return None
    n = tuning.steps
    while True:
        try:
            return batches_for(model, dataclasses.replace(source, batch_size=tuning.rows, calib_batches=n), "train", tokenizer)
        except MinifloatError:
            if n == 1:
                raise
            n = max(1, n // 2)


def quantize_in_memory(model: torch.nn.Module, scheme: str | QuantConfig, tokenizer=None, *,
                       source: TextSource = TextSource(), quantize_head: bool = False,  # noqa: B008 - frozen
                       method: str | PTQMethod = "rtn") -> QuantizeSummary:  # fmt: skip
    """Quantize `model` in place with `scheme` by `method` (the LM head and embedding too with
    `quantize_head`), calibrating on `source`'s training split when the config or method needs it."""
    config = get_quant_config(scheme)
    method = resolve_method(method, config)
    cal = _calibration(model, config, method, source, tokenizer)
    return quantize_model(model, config, calibration=cal, quantize_head=quantize_head, method=method,
                          tuning=tuning_batches(model, method, source, tokenizer))  # fmt: skip


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
    unquantized when no reference is given. ``text`` says how the text became windows."""
    model = load_model(model_path)  # the built-in GPT as it is: evaluation needs no transformers
    reference = load_model(reference_path) if reference_path else None
    tokenizer = tokenizer_for(model_path)
    if scheme is not None:
        method = resolve_method(method, get_quant_config(scheme))  # an unknown name: an error before the copy
        reference = reference if reference is not None else copy.deepcopy(model)
        quantize_in_memory(model, scheme, tokenizer, source=source, quantize_head=quantize_head, method=method)
    return evaluate(model, reference, batches_for(model, source, "val", tokenizer)) | {
        "text": text_conventions(source, tokenizer)}
