"""LoRA as users run it without minifloat — transformers + PEFT on a BF16 base, or bitsandbytes'
NF4 base (QLoRA) — run by *the peer's own* Python (its venv), never imported by minifloat:
`compare MODEL --lora R --peers peft-bf16,bnb-nf4 --peer-python PYTHON` runs this file as a
script on the very windows the minifloat runs train and validate on.

    PYTHON peft_peer.py MODEL --windows windows.npz --base bf16|nf4 --rank R --alpha A --lr LR ...

``windows.npz``: ``train_ids`` / ``train_labels`` (steps × grad_accum × B × T) and ``val_ids`` /
``val_labels`` (batches × B × T), int64, labels -100 where the loss does not count. The schedule
is minifloat's (linear warmup, cosine decay to ``min_lr_ratio``), AdamW (0.9, 0.95) with the
weight decay on the adapter matrices, gradient clipping. Prints one JSON line: the base model's
and the final validation loss, the median step time, tokens/s, and the training state's bytes
(parameters, buffers, optimizer state, gradients; each storage once). This file imports nothing
from minifloat.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path


def _lr(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--windows", required=True)
    p.add_argument("--base", choices=("bf16", "nf4"), default="bf16")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--alpha", type=float, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    w = np.load(a.windows)
    train_ids, train_labels = torch.from_numpy(w["train_ids"]), torch.from_numpy(w["train_labels"])
    val = list(zip(torch.from_numpy(w["val_ids"]), torch.from_numpy(w["val_labels"]), strict=True))
    a.steps = train_ids.shape[0]
    path = Path(a.model)
    plain = None
    if a.base == "nf4" and path.suffix == ".gguf":  # transformers quantizes no GGUF on load: through a plain folder
        import tempfile

        plain = tempfile.TemporaryDirectory()
        dense = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
        dense.hf_quantizer, dense.is_quantized = None, False  # dequantized on load; it only calls itself quantized
        if hasattr(dense.config, "quantization_config"):
            del dense.config.quantization_config
        dense.save_pretrained(plain.name)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(plain.name)
        path = Path(plain.name)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    if a.base == "nf4":
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path.parent if "gguf_file" in kw else path, dtype=torch.bfloat16, **kw)
    if plain is not None:
        plain.cleanup()  # the quantized model holds its own copies
    model.config.use_cache = False
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(a.seed)
    model = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=targets, task_type="CAUSAL_LM"))
    for prm in model.parameters():  # the adapters in FP32, as minifloat's default
        if prm.requires_grad:
            prm.data = prm.data.float()
    trained = [prm for prm in model.parameters() if prm.requires_grad]
    opt = torch.optim.AdamW(trained, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)

    def loss_of(ids, labels):
        logits = model(input_ids=ids, use_cache=False).logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        out = sum(loss_of(i, lab).item() for i, lab in val) / len(val)
        model.train()
        return out

    base_val = evaluate()
    times, state = [], None
    for step in range(a.steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = _lr(step, a)
        accum = train_ids.shape[1]
        for k in range(accum):
            (loss_of(train_ids[step, k], train_labels[step, k]) / accum).backward()
        torch.nn.utils.clip_grad_norm_(trained, a.grad_clip if a.grad_clip > 0 else float("inf"))
        opt.step()
        if state is None:
            state = _state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    step_time = statistics.median(times[max(1, len(times) // 10) :] or times)
    tokens = train_ids.shape[1] * train_ids.shape[2] * train_ids.shape[3]
    print(json.dumps({"base_val_loss": base_val, "final_val_loss": evaluate(), "step_time_s": step_time,
                      "tokens_per_s": tokens / step_time, "state_bytes": state, "steps": a.steps}))  # fmt: skip


def _state_bytes(model, opt) -> dict:
    import torch

    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = list(model.parameters())
    out = {"trained_parameters": count(q for q in params if q.requires_grad),
           "frozen_parameters": count(q for q in params if not q.requires_grad), "buffers": count(model.buffers()),
           "optimizer": count(v for st in opt.state.values() for v in st.values()),
           "gradients": sum(q.numel() * q.element_size() for q in params if q.requires_grad)}  # fmt: skip
    out["total"] = sum(out.values())
    return out


if __name__ == "__main__":
    main()
