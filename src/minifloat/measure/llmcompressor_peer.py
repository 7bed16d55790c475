"""llm-compressor's PTQ of a model, run by *llm-compressor's own* Python (its venv: it pins other
transformers / compressed-tensors versions), never imported by minifloat: `ptq-compare
--llmcompressor PYTHON` runs this file as a script and compares through the compressed-tensors
checkpoint it writes, which minifloat's side loads with its own transformers + compressed-tensors.

    PYTHON llmcompressor_peer.py MODEL --scheme NVFP4A16 --method gptq --calib ids.npy --out DIR

MODEL: a transformers folder or a ``.gguf`` file; ``ids.npy``: the calibration token ids
(samples × tokens, int64), the same windows minifloat calibrates on. Prints one JSON line.
This file imports nothing from minifloat.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--scheme", required=True)
    p.add_argument("--method", choices=("rtn", "gptq"), default="gptq")
    p.add_argument("--calib", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(a.model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent if kw else path, dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(path.parent if kw else path, **kw)
    if kw:  # llm-compressor re-reads the config from the model's folder: a dense copy of the GGUF's
        dense = Path(a.out + ".dense")
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the GGUF's, dequantized on load: the weights are dense now
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(model.state_dict())
        fresh.save_pretrained(dense)
        tokenizer.save_pretrained(dense)
        model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    ids = np.load(a.calib)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    make = GPTQModifier if a.method == "gptq" else QuantizationModifier
    recipe = make(targets="Linear", scheme=a.scheme, ignore=["lm_head"])
    start = time.perf_counter()
    oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=len(ids))
    seconds = time.perf_counter() - start
    model.save_pretrained(a.out, save_compressed=True)
    print(json.dumps({"seconds": seconds, "out": a.out, "scheme": a.scheme, "method": a.method}))


if __name__ == "__main__":
    main()
