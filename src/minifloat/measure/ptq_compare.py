"""`minifloat ptq-compare`: quantize one trained model with several configs and measure each.

Every config quantizes a fresh copy of the model as it was trained (the built-in GPT with its
fused qkv: a per-tensor scale spans q, k and v, where the exported OPT has one each; static
configs calibrate on the corpus' training split) and is evaluated
on the same held-out batches against the unquantized model: Δ perplexity, KL, top-1 agreement,
bytes of the weights at rest, bits per weight, tokens/s. torchao's post-training quantization of
the same model runs beside it where torchao has the scheme on this device (`TORCHAO_PEERS`);
where it does not, the reason is recorded instead of a figure.

With ``methods`` (``rtn``, ``gptq``) each config runs once per method, each row naming its
method and the seconds quantization took. With ``llmcompressor`` (the Python of a venv that has
llm-compressor, which pins other transformers / compressed-tensors versions) llm-compressor's
GPTQ of the same model, on the same calibration windows, runs beside minifloat's where it has
the scheme (`LLMCOMPRESSOR_SCHEMES`): `minifloat.measure.llmcompressor_peer` is run as a
script by that Python, and its compressed-tensors checkpoint is loaded here by transformers and
evaluated on the same batches — never imported.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from minifloat.data.text import TextSource, batches_for, text_conventions, tokenizer_for
from minifloat.errors import MinifloatError
from minifloat.infer import QUANT_CONFIGS, get_quant_config, quantize_model
from minifloat.infer.checkpoints.loaders import load_model
from minifloat.infer.evaluation.metrics import evaluate
from minifloat.infer.evaluation.pipeline import tuning_batches
from minifloat.infer.modules.accounting import bits_per_weight, model_bytes, weight_layers
from minifloat.infer.ptq.method import resolve_method
from minifloat.infer.quantize import calibrate
from minifloat.io import jsonio
from minifloat.io.atomic import atomic_path
from minifloat.measure.bench import _quiet_torchao_import
from minifloat.measure.compare import environment
from minifloat.report.ptq import write_ptq_report

DEFAULT_SCHEMES = ("fp8-dynamic", "fp8-block", "mxfp8", "mxfp6", "mxfp4", "nvfp4")

# llm-compressor's preset scheme for each minifloat config it has (compressed-tensors' names)
LLMCOMPRESSOR_SCHEMES = {
    "fp8-dynamic": "FP8_DYNAMIC", "fp8-static": "FP8", "fp8-block": "FP8_BLOCK", "mxfp8": "MXFP8",
    "mxfp8-weight-only": "MXFP8A16", "mxfp4": "MXFP4", "mxfp4-weight-only": "MXFP4A16", "nvfp4": "NVFP4",
    "nvfp4-weight-only": "NVFP4A16",
}  # fmt: skip
PEER_TIMEOUT_S = 3600


def llmcompressor_run(python: str, model_path, name: str, calib: list[torch.Tensor], out: Path, reference, batches,
                      method: str = "gptq") -> dict:  # fmt: skip
    """llm-compressor's `method` of the model at `model_path` in config `name`'s scheme, run by
    `python` (its own venv), then loaded from its checkpoint and evaluated here against `reference`."""
    row = {"config": name, "method": method, "peer": "llm-compressor"}
    scheme = LLMCOMPRESSOR_SCHEMES.get(name)
    if scheme is None:
        return row | {"status": "skipped", "reason": f"llm-compressor has no preset scheme for {name}"}
    if not (Path(model_path).suffix == ".gguf" or (Path(model_path) / "config.json").is_file()):
        return row | {"status": "skipped", "reason": "llm-compressor loads transformers models (a folder or GGUF) only"}
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    ids = out / "calib.npy"
    np.save(ids, torch.cat(calib)[:, :-1].numpy())  # the windows minifloat calibrates on, without the next-token column
    dest = out / f"{name}-{method}"
    script = Path(__file__).with_name("llmcompressor_peer.py")
    cmd = [python, str(script), str(model_path), "--scheme", scheme, "--method", method, "--calib", str(ids), "--out", str(dest)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return row | {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return row | {"status": "failed", "reason": f"exit {done.returncode}: {tail[0][:300]}"}
    info = json.loads(done.stdout.strip().splitlines()[-1])
    model = load_model(dest)
    return row | {"status": "ok", "scheme": scheme, "quantize_seconds": info["seconds"], **evaluate(model, reference, batches)}


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
    methods: Sequence[str] = ("rtn",),
    overrides: dict | None = None,
    llmcompressor: str | None = None,
) -> dict:
    """Quantize the model at `model_path` with each of `schemes`, evaluate each against the
    unquantized model (and torchao's where it runs), write ``metrics.json`` and ``report.md``
    (with ``quality.png``) under `out`; returns the metrics. `quantize_head`: the LM head and the
    embedding too (weight-only); each row has bits/weight over the Linears and over every weight
    (head and embedding included), the model's bytes and the seconds quantization took.
    `methods`: each config once per PTQ method (``rtn``, ``gptq``), with `overrides` of the
    method's parts (`resolve_method`); `llmcompressor`: see the module docstring."""
    configs = [get_quant_config(s) for s in schemes]  # unknown names fail before any work
    overrides = overrides or {}
    # bad options: before any work; asymmetric calibration refits GPTQ's weights, so only its runs take it
    plans = [(c, resolve_method(m, c, **{k: v for k, v in overrides.items() if m == "gptq" or k != "asymmetric"}))
             for c in configs for m in methods]  # fmt: skip
    if llmcompressor is not None and not Path(llmcompressor).is_file():
        raise MinifloatError(f"--llmcompressor {llmcompressor}: no such Python; give the python of a venv with llm-compressor")
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
         f"the embedding not counted), {len(batches)} × {tuple(batches[0].shape)} tokens; "
         f"{text_conventions(source, tokenizer)}")  # fmt: skip
    base = evaluate(reference, None, batches)
    base_row = {"config": "reference", "status": "ok", **base, "bits_per_weight": bits_per_weight(reference),
                "bits_per_weight_all": bits_per_weight(reference, head=True, embedding=True),
                "model_bytes": model_bytes(reference)}  # fmt: skip
    runs, peers, lc_peers = [], [], []
    calibration = calibrate(reference, calib) if any(c.needs_calibration for c in configs) else None
    for c, method in plans:
        model = copy.deepcopy(reference)
        start = time.perf_counter()
        cal = calib if method.sequential else calibration
        summary = quantize_model(model, c, calibration=cal, ignore=ignore, quantize_head=quantize_head, method=method,
                                 tuning=tuning_batches(reference, method, source, tokenizer))  # fmt: skip
        seconds = time.perf_counter() - start
        m = evaluate(model, reference, batches)
        row = {"config": c.name, "method": method.label, "method_config": method.to_dict(), "status": "ok", **m, "bits_per_weight": bits_per_weight(model),
               "bits_per_weight_all": bits_per_weight(model, head=True, embedding=True), "model_bytes": model_bytes(model),
               "quantize_seconds": seconds, "quantize_head": quantize_head,
               "quantized_layers": len(summary.quantized), "skipped": {s.name: s.reason for s in summary.skipped}}  # fmt: skip
        runs.append(row)
        echo(f"  {c.name:<18} {method.label:<14} Δppl {row['delta_ppl_pct']:+.2f} %  KL {row['kl']:.2e}  top-1 "
             f"{row['top1']:.4f}  {row['bits_per_weight']:.2f} bits/weight ({row['bits_per_weight_all']:.2f} with head and "
             f"embedding)  {row['tokens_per_s']:,.0f} tok/s  quantized in {seconds:.0f} s")  # fmt: skip
        if llmcompressor is not None and method.method == "gptq" and not quantize_head:
            p = llmcompressor_run(llmcompressor, model_path, c.name, calib, out / "llmcompressor", reference, batches)
            if p["status"] == "ok":
                echo(f"  {'llm-compressor':<18} {'gptq':<14} Δppl {p['delta_ppl_pct']:+.2f} %  KL {p['kl']:.2e}  top-1 "
                     f"{p['top1']:.4f}  quantized in {p['quantize_seconds']:.0f} s")  # fmt: skip
            else:
                echo(f"  {'llm-compressor':<18} {p['status']}: {p['reason']}")
            lc_peers.append(p)
        if torchao and method.method == "rtn":
            p = _torchao_run(reference, c.name, reference, batches, ignore)
            if p["status"] == "ok":
                echo(f"  {'torchao ' + c.name:<18} Δppl {p['delta_ppl_pct']:+.2f} %  KL {p['kl']:.2e}  top-1 "
                     f"{p['top1']:.4f}  {p['tokens_per_s']:,.0f} tok/s")  # fmt: skip
            peers.append(p)
    metrics = {
        "model": str(model_path), "reference": base_row, "runs": runs, "torchao": peers, "llmcompressor": lc_peers,
        "data": {**dataclasses.asdict(source), "tokens": base["tokens"], "text": text_conventions(source, tokenizer)},
        "env": environment(),
    }  # fmt: skip
    with atomic_path(out / "metrics.json") as tmp:
        tmp.write_text(jsonio.dumps(metrics, indent=2))
    write_ptq_report(metrics, out, plots=plots)
    return metrics

