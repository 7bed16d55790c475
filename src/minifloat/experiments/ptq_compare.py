"""`minifloat ptq-compare`: quantize one trained model with several configs and measure each.

Every config quantizes a fresh copy of the model as it was trained (the built-in GPT with its
fused qkv: a per-tensor scale spans q, k and v, where the exported OPT has one each; static
configs calibrate on the corpus' training split) and is evaluated
on the same held-out batches against the unquantized model: Δ perplexity, KL, top-1 agreement,
bytes of the weights at rest, bits per weight, tokens/s. torchao's post-training quantization of
the same model runs beside it where torchao has the scheme on this device (`TORCHAO_PEERS`);
where it does not, the reason is recorded instead of a figure.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from minifloat.errors import MinifloatError
from minifloat.experiments.bench import _quiet_torchao_import
from minifloat.experiments.compare import environment
from minifloat.infer import QUANT_CONFIGS, get_quant_config, quantize_model
from minifloat.infer.accounting import bits_per_weight, model_bytes, weight_layers
from minifloat.infer.metrics import evaluate
from minifloat.infer.models import load_model
from minifloat.infer.pipeline import TextSource, batches_for, tokenizer_for
from minifloat.infer.ptq import calibrate
from minifloat.io import jsonio
from minifloat.io.atomic import atomic_path
from minifloat.report.ptq import write_ptq_report

DEFAULT_SCHEMES = ("fp8-dynamic", "fp8-block", "mxfp8", "mxfp6", "mxfp4", "nvfp4")


def torchao_peer(name: str) -> tuple[Callable[[], object] | None, str, torch.dtype]:
    """(a factory of torchao's config for minifloat config `name`, or None; why not / what it is;
    the dtype torchao's path needs the model in)."""
    try:
        with _quiet_torchao_import():
            import torchao.prototype.mx_formats as mx
            from torchao.quantization import Float8WeightOnlyConfig
            from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except Exception:  # noqa: BLE001 - any import failure means "not installed"
        return None, "torchao is not installed (pip install 'minifloat[bench]')", torch.float32
    cuda_only = {
        "fp8-dynamic": "Float8DynamicActivationFloat8WeightConfig(PerRow) needs CUDA capability ≥ 8.9",
        "fp8-static": "torchao has no calibrated per-tensor FP8 activation config",
        "fp8-block": "Float8DynamicActivationFloat8WeightConfig with 128×128 blocks needs CUDA",
        "nvfp4": "NVFP4DynamicActivationNVFP4WeightConfig needs CUDA capability ≥ 10.0",
        "mxfp6": "torchao's MX inference config has no FP6 element",
    }
    emulated = KernelPreference.EMULATED
    peers = {
        "fp8-weight-only": (lambda: Float8WeightOnlyConfig(), "Float8WeightOnlyConfig", torch.float32),
        "mxfp8": (lambda: mx.MXDynamicActivationMXWeightConfig(activation_dtype=torch.float8_e4m3fn,
                  weight_dtype=torch.float8_e4m3fn, kernel_preference=emulated),
                  "MXDynamicActivationMXWeightConfig(e4m3, emulated; bf16 model)", torch.bfloat16),
        "mxfp4": (lambda: mx.MXDynamicActivationMXWeightConfig(activation_dtype=torch.float4_e2m1fn_x2,
                  weight_dtype=torch.float4_e2m1fn_x2, kernel_preference=emulated),
                  "MXDynamicActivationMXWeightConfig(e2m1, emulated; bf16 model)", torch.bfloat16),
        "mxfp4-weight-only": (None, "torchao's MX weight-only inference config was removed", torch.float32),
        "nvfp4-weight-only": (lambda: mx.NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True),
                              "NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)", torch.float32),
    }  # fmt: skip
    if name in peers:
        return peers[name]
    return None, cuda_only.get(name, f"torchao has no config matching {name}"), torch.float32


def _torchao_run(model, name: str, reference, batches, ignore: Sequence[str]) -> dict:
    make, what, dtype = torchao_peer(name)
    if make is None:
        return {"config": name, "status": "not run", "why": what}
    from torchao.quantization import quantize_

    m = copy.deepcopy(model).to(dtype)
    skip = tuple(ignore)

    def want(module, fqn):
        return isinstance(module, torch.nn.Linear) and not any(fqn == p or fqn.endswith("." + p) for p in skip)

    try:
        with _quiet_torchao_import():
            quantize_(m, make(), filter_fn=want)
        metrics = evaluate(m, reference, batches) | {"bits_per_weight": bits_per_weight(m)}
    except Exception as err:  # noqa: BLE001 - a peer that fails is reported, not fatal
        return {"config": name, "status": "failed", "why": f"{what}: {type(err).__name__}: {err}"[:300]}
    return {"config": name, "status": "ok", "what": what, **metrics}


def ptq_compare(
    model_path: str | os.PathLike[str],
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    out: str | os.PathLike[str] = "runs/ptq",
    *,
    source: TextSource = TextSource(),  # noqa: B008 - frozen
    torchao: bool = True,
    plots: bool = True,
    ignore: Sequence[str] = ("lm_head",),
    echo: Callable[[str], None] = print,
    quantize_head: bool = False,
) -> dict:
    """Quantize the model at `model_path` with each of `schemes`, evaluate each against the
    unquantized model (and torchao's where it runs), write ``metrics.json`` and ``report.md``
    (with ``quality.png``) under `out`; returns the metrics. `quantize_head`: the LM head and the
    embedding too (weight-only); each row has bits/weight over the Linears and over every weight
    (head and embedding included), the model's bytes and the seconds quantization took."""
    configs = [get_quant_config(s) for s in schemes]  # unknown names fail before any work
    if not configs:
        raise MinifloatError(f"--schemes needs at least one of {', '.join(QUANT_CONFIGS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reference = load_model(model_path)
    tokenizer = tokenizer_for(model_path)
    batches = batches_for(reference, source, "val", tokenizer)
    calib = batches_for(reference, source, "train", tokenizer)
    n_weights = sum(m.weight.numel() for m in weight_layers(reference).values())
    echo(f"reference: {type(reference).__name__}, {n_weights:,} Linear weights (bits/weight over them: the head and "
         f"the embedding not counted), {len(batches)} × {tuple(batches[0].shape)} tokens")  # fmt: skip
    base = evaluate(reference, None, batches)
    base_row = {"config": "reference", "status": "ok", **base, "bits_per_weight": bits_per_weight(reference),
                "bits_per_weight_all": bits_per_weight(reference, head=True, embedding=True),
                "model_bytes": model_bytes(reference)}  # fmt: skip
    runs, peers = [], []
    calibration = calibrate(reference, calib) if any(c.needs_calibration for c in configs) else None
    for c in configs:
        model = copy.deepcopy(reference)
        start = time.perf_counter()
        summary = quantize_model(model, c, calibration=calibration, ignore=ignore, quantize_head=quantize_head)
        seconds = time.perf_counter() - start
        m = evaluate(model, reference, batches)
        row = {"config": c.name, "status": "ok", **m, "bits_per_weight": bits_per_weight(model),
               "bits_per_weight_all": bits_per_weight(model, head=True, embedding=True), "model_bytes": model_bytes(model),
               "quantize_seconds": seconds, "quantize_head": quantize_head,
               "quantized_layers": len(summary.quantized), "skipped": {s.name: s.reason for s in summary.skipped}}  # fmt: skip
        runs.append(row)
        echo(f"  {c.name:<18} Δppl {row['delta_ppl_pct']:+.2f} %  KL {row['kl']:.2e}  top-1 {row['top1']:.4f}  "
             f"{row['bits_per_weight']:.2f} bits/weight ({row['bits_per_weight_all']:.2f} with head and embedding)  "
             f"{row['tokens_per_s']:,.0f} tok/s")  # fmt: skip
        if torchao:
            p = _torchao_run(reference, c.name, reference, batches, ignore)
            if p["status"] == "ok":
                echo(f"  {'torchao ' + c.name:<18} Δppl {p['delta_ppl_pct']:+.2f} %  KL {p['kl']:.2e}  top-1 "
                     f"{p['top1']:.4f}  {p['tokens_per_s']:,.0f} tok/s")  # fmt: skip
            peers.append(p)
    metrics = {
        "model": str(model_path), "reference": base_row, "runs": runs, "torchao": peers,
        "data": {**dataclasses.asdict(source), "tokens": base["tokens"]}, "env": environment(),
    }  # fmt: skip
    with atomic_path(out / "metrics.json") as tmp:
        tmp.write_text(jsonio.dumps(metrics, indent=2))
    write_ptq_report(metrics, out, plots=plots)
    return metrics

