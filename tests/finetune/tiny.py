"""Tiny random transformers models with a real byte-level tokenizer and a chat template, written
as model folders: what the fine-tuning tests train (seconds, no download)."""

from pathlib import Path

import torch

SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]  # a turn ends with EOS (</s>), as SmolLM2's
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip


def byte_tokenizer(bos: bool = True):
    """Every byte a token (BPE without merges over the byte-level alphabet), the special tokens
    above; BOS in front of every text when `bos` (Llama's habit), none otherwise (Qwen's)."""
    import tokenizers
    import transformers

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL + sorted(alphabet))}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    if bos:
        tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                                additional_special_tokens=SPECIAL[3:])  # fmt: skip
    fast.chat_template = TEMPLATE
    return fast


def tiny_model(folder: Path, family: str = "llama", *, tied: bool = True, seed: int = 0) -> Path:
    """A random `family` (llama, qwen2) causal LM of 2 decoder layers and its tokenizer in `folder`."""
    import transformers

    tokenizer = byte_tokenizer(bos=family == "llama")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
                  bos_token_id=1, eos_token_id=2)  # fmt: skip
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # weights of a trained model's size, not the initialiser's tiny ones: the logits matter
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
