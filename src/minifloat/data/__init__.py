"""Text both halves stand on: corpora (`corpus`: the embedded Python stdlib sources, a file or
folder of text, split into training and held-out bytes), the token windows calibration and
evaluation read from them (`text`), and supervised fine-tuning records rendered with a
tokenizer's chat template, the loss on the responses only, packed (`sft`)."""

from minifloat.data.corpus import Corpus, get_batch, load_corpus, stdlib_corpus
from minifloat.data.text import TextSource, batches_for, token_batches, token_ids, tokenizer_for

__all__ = [
    "Corpus",
    "stdlib_corpus",
    "load_corpus",
    "get_batch",
    "TextSource",
    "batches_for",
    "token_batches",
    "token_ids",
    "tokenizer_for",
]
