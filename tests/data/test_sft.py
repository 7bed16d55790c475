"""SFT records: rendered with a real (tiny) transformers tokenizer and chat template, the loss on
the responses only (checked through autograd: a prompt token gets no gradient), packing that
keeps each record whole and its attention inside it (against a brute-force mask)."""

import json

import pytest
import torch

import minifloat
from minifloat.data.sft import IGNORE, Example, block_causal_mask, load_sft, pack, render

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
         "what", "is", "a", "list", "it", "holds", "items", "be", "brief", "ok", "thanks", "?", "."]  # fmt: skip
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")  # fmt: skip


def tokenizer(template=TEMPLATE):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = template
    return fast


def ids(words: str) -> list[int]:
    return [WORDS.index(w) for w in words.split()]


def write(tmp_path, records) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_only_the_assistant_turns_and_the_completion_count():
    tok = tokenizer()
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a list ?"},
                         {"role": "assistant", "content": "it holds items ."}, {"role": "user", "content": "thanks"},
                         {"role": "assistant", "content": "ok"}]}  # fmt: skip
    ex = render(chat, tok)
    # the template's text, tokenized here word by word: every token of it, and which are responses
    assert ex.input_ids == ids("<|system|> be brief <|end|> <|user|> what is a list ? <|end|> "
                               "<|assistant|> it holds items . <|end|> <|user|> thanks <|end|> <|assistant|> ok <|end|>")
    counted = [t for t, label in zip(ex.input_ids, ex.labels, strict=True) if label != IGNORE]
    assert counted == ids("it holds items . <|end|> ok <|end|>")
    plain = render({"prompt": "what is a list ?", "completion": "it holds items ."}, tok)
    assert plain.input_ids == [1, *ids("what is a list ? it holds items ."), 2]  # BOS as the tokenizer adds it, then EOS
    assert [t for t, label in zip(plain.input_ids, plain.labels, strict=True) if label != IGNORE] == [*ids("it holds items ."), 2]


def test_a_prompt_token_gets_no_gradient(tmp_path):
    tok = tokenizer()
    path = write(tmp_path, [{"prompt": "what is a list ?", "completion": "it holds items ."},
                            {"messages": [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": "ok"}]}])  # fmt: skip
    (row,) = pack(load_sft(path, tok), seq_len=32, pad_id=0)
    logits = torch.randn(32, len(WORDS), requires_grad=True)
    torch.nn.functional.cross_entropy(logits, row.labels, ignore_index=IGNORE).backward()
    has_grad = logits.grad.abs().sum(-1) > 0
    # the window, written out: record 1 "<s> what is a list ? | it holds items . </s>" (11 tokens, the
    # response from index 6), record 2 "<|user|> thanks <|end|> <|assistant|> | ok <|end|>" at 11 (from
    # index 4); position t predicts token t + 1, so the gradient is at 5..9 and 14..15 and nowhere else
    assert row.input_ids[:17].tolist() == [1, *ids("what is a list ? it holds items ."), 2,
                                           *ids("<|user|> thanks <|end|> <|assistant|> ok <|end|>")]
    assert torch.nonzero(has_grad).flatten().tolist() == [5, 6, 7, 8, 9, 14, 15]


def test_packing_keeps_records_whole_and_attention_inside_them():
    exs = [Example(list(range(10, 10 + n)), [IGNORE] + list(range(11, 10 + n)), line) for line, n in enumerate((5, 4, 6, 3), 1)]
    rows = pack(exs, seq_len=10, pad_id=0)
    assert [r.segment_ids.tolist() for r in rows] == [[0] * 5 + [1] * 4 + [-1], [0] * 6 + [1] * 3 + [-1]]
    assert rows[0].position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    seg = torch.stack([r.segment_ids for r in rows])
    mask = block_causal_mask(seg)
    for b in range(2):
        for q in range(10):
            for k in range(10):
                want = (k <= q and seg[b, q] == seg[b, k]) or q == k
                assert bool(mask[b, 0, q, k]) == want
    with pytest.raises(minifloat.MinifloatError, match="the record on line 3 has 6 tokens, more than the 5 of a window"):
        pack(exs, seq_len=5, pad_id=0)


@pytest.mark.parametrize(
    ("line", "message"),
    [("{not json", "line 2: not JSON"),
     (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "line 2: no assistant message"),
     (json.dumps({"messages": [{"role": "bot", "content": "hi"}]}), "line 2: message 0 must be"),
     (json.dumps({"text": "hi"}), "line 2: a record needs 'messages', or 'prompt' and 'completion'")],
)
def test_a_malformed_line_is_named(tmp_path, line, message):
    path = write(tmp_path, [{"prompt": "what", "completion": "ok"}, line])
    with pytest.raises(minifloat.MinifloatError, match=message):
        load_sft(path, tokenizer())


def test_messages_need_a_chat_template(tmp_path):
    path = write(tmp_path, [{"messages": [{"role": "user", "content": "what"}, {"role": "assistant", "content": "ok"}]}])
    with pytest.raises(minifloat.MinifloatError, match="the tokenizer has no chat template"):
        load_sft(path, tokenizer(template=None))
