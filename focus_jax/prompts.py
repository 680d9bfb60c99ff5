"""Prompts as callers give them, turned into the token ids the engine takes: text through the
tokenizer (and its chat template), token ids checked, so that a wrong type fails here with its
name instead of turning into other tokens further down."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from focus_jax.config import ConfigError, is_integer
from focus_jax.model import Model

Prompt = str | Sequence[int] | np.ndarray
"""Text, or token ids: a list or tuple of integers (Python or NumPy) or a 1-D integer array."""


def is_single(prompts: Any) -> bool:
    """Whether ``prompts`` is one prompt (text, token ids) rather than a list of prompts: text,
    a 1-D array, or a sequence whose first element is a number."""
    if isinstance(prompts, str | bytes | bytearray | Mapping):
        return True
    if hasattr(prompts, "ndim") and hasattr(prompts, "dtype"):  # NumPy and JAX arrays
        return prompts.ndim <= 1
    return (isinstance(prompts, Sequence) and len(prompts) > 0
            and isinstance(prompts[0], numbers.Number))


def token_ids(prompt: Any, name: str = "prompt") -> list[int]:
    """The token ids of a prompt given as ids (``name`` says which prompt in messages).

    Raises ``TypeError`` for anything but integers: bytes, mappings, floats and bools would
    otherwise be read as other tokens (a float truncated, a byte string as its byte values).
    """
    if isinstance(prompt, bytes | bytearray):
        raise TypeError(f"{name} is bytes: decode it to text (prompt.decode('utf-8')) or pass "
                        f"token ids")
    if isinstance(prompt, Mapping):
        raise TypeError(f"{name} has type {type(prompt).__name__}: pass its text (a str) or "
                        f"token ids (messages are not taken: the chat template is applied to text)")
    if hasattr(prompt, "ndim") and hasattr(prompt, "dtype"):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(f"{name} is an array of shape {tuple(prompt.shape)} and dtype "
                            f"{prompt.dtype}: token ids must be a 1-D integer array")
        return np.asarray(prompt).astype(np.int64).tolist()
    if not isinstance(prompt, Sequence):
        raise TypeError(f"{name} has type {type(prompt).__name__}: pass text (a str) or token "
                        f"ids (a list of integers)")
    for position, token in enumerate(prompt):
        if not is_integer(token):
            raise TypeError(f"{name}: token {position} is {token!r} "
                            f"({type(token).__name__}): token ids must be integers")
    return [int(t) for t in prompt]


def encode_prompt(model: Model, prompt: Prompt, chat: bool = True,
                  name: str = "prompt") -> list[int]:
    """Token ids of a prompt: text goes through the tokenizer (and its chat template, if any);
    token ids are checked (:func:`token_ids`; ``name`` says which prompt in messages)."""
    if not isinstance(prompt, str):
        return token_ids(prompt, name)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ConfigError("this model was loaded without a tokenizer: pass token ids, or load "
                          "it with tokenizer=True")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]


def read_lines(path: Path, expected: str) -> tuple[list[str], bytes]:
    """The lines of a UTF-8 text file and its bytes. A missing file, a folder or bytes that are
    not UTF-8 are a ``ConfigError`` naming the file (and line); ``expected`` says what to give
    instead ("a text file with one prompt per line")."""
    if not path.is_file():
        raise ConfigError(f"{path} {'is a folder' if path.is_dir() else 'does not exist'}: give "
                          f"{expected}")
    content = path.read_bytes()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as err:
        line = content[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text") from None
    # Split on newlines only: str.splitlines also splits inside strings at U+2028 and others.
    return text.split("\n"), content


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a text file, one per non-blank line (``ConfigError`` as :func:`read_lines`,
    and for a file without a prompt)."""
    lines, _ = read_lines(path, "a text file with one prompt per line")
    prompts = [line.rstrip("\r") for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"{path} is empty: give a text file with one prompt per line")
    return prompts
