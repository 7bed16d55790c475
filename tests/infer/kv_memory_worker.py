"""Run as ``python -m tests.infer.kv_memory_worker FORMAT TOKENS``: decode TOKENS tokens of a random
transformers Llama with a minifloat KV cache of FORMAT in this fresh process and print the growth
of the process's peak resident memory over the decode (after a warm-up), in bytes."""

import sys

import torch
import transformers

from minifloat.infer.generation.hf_cache import quantized_cache


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))  # kB


def reset_peak() -> int:
    """Reset the peak resident memory (VmHWM) to the current one (Linux ≥ 4.0); return it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def main(fmt: str, tokens: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        warm = quantized_cache(model.config, fmt)
        for _ in range(4):
            model(input_ids=ids, past_key_values=warm, use_cache=True)
        del warm
        before = reset_peak()
        cache = quantized_cache(model.config, fmt)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(tokens - ids.shape[1]):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    print(_status("VmHWM") - before, cache.nbytes())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
