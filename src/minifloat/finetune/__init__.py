"""Fine-tuning pretrained LLMs: continued pretraining, SFT and LoRA on a frozen (packed) base.

It stands on both halves: the training loop (`minifloat.train`) runs a `PretrainedTask`, whose
LoRA base may be held in inference's packed layers (`minifloat.infer`)."""

from minifloat.finetune.lora import LoRALinear, save_adapter
from minifloat.finetune.pretrained import PretrainedTask, load_pretrained

__all__ = ["PretrainedTask", "LoRALinear", "load_pretrained", "save_adapter"]
