"""Byte-pair tokenizers for models trained from scratch, with the special tokens and the chat
format focus_jax's own models use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def wrap(core: Any) -> Any:
    """A ``transformers`` fast tokenizer around a ``tokenizers.Tokenizer`` with our specials."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>",
        mask_token="<|mask|>", additional_special_tokens=["<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A BPE tokenizer trained on ``texts``: digits split one per token (arithmetic stays
    positional), punctuation split off, spaces kept (Metaspace), special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation()])
    core.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=False)
    core.train_from_iterator(texts, trainer)
    return wrap(core)
