"""Run as ``python -m tests.infer.ptq_memory_worker``: GPTQ a random transformers Llama whose
untied LM head (32768 × 256) holds most of its weights, the head included, in this fresh process,
and print the growth of the process's peak resident memory over `quantize_model` and the head's
FP32 bytes."""

import torch
import transformers

from minifloat.infer import quantize_model
from tests.infer.kv_memory_worker import _status, reset_peak


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    calibration = [torch.randint(0, 32768, (2, 64)) for _ in range(2)]
    head = model.lm_head.weight.numel() * 4
    before = reset_peak()
    quantize_model(model, "nvfp4-weight-only", method="gptq", calibration=calibration, quantize_head=True)
    print(_status("VmHWM") - before, head)


if __name__ == "__main__":
    main()
