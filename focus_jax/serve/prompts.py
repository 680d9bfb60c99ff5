"""Prompts as token ids: completions take text or ids as they are, chat goes through the model's
chat template."""

from __future__ import annotations

from collections.abc import Sequence

import jinja2

from focus_jax.api import encode_prompt
from focus_jax.model import Model
from focus_jax.serve.errors import invalid


def completion_prompt_ids(model: Model, prompt: str | Sequence[int]) -> list[int]:
    """The ids of a completion prompt (text is tokenized without a chat template)."""
    return encode_prompt(model, prompt, chat=False)


def chat_prompt_ids(model: Model, messages: list[dict[str, str]]) -> list[int]:
    """The ids of a conversation rendered by the model's chat template, ready for the
    assistant's turn. A single user message gives what ``encode_prompt(model, text)`` gives."""
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template: use /v1/completions", param="messages")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
    except jinja2.TemplateError as err:
        raise invalid(f"the chat template refused these messages: {err}", param="messages") from None
    return encode_prompt(model, rendered, chat=False)
