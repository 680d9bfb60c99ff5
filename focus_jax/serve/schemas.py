"""The bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``, validated.

Field names and meanings follow the OpenAI API; ``top_k``, ``threshold``, ``alpha``,
``commit_refresh`` and ``ignore_eos`` are extra body fields (``extra_body=`` in the ``openai``
client). Unknown fields
are ignored; fields this server does not implement are refused with a 400 that says so.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from focus_jax.engine import SamplingParams
from focus_jax.serve.errors import invalid, unsupported

MAX_STOP_STRINGS = 8


class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestBody(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: tuple[str, ...] = ()
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = Field(None, ge=0)
    threshold: float | None = Field(None, ge=0, le=1)
    alpha: float | None = Field(None, gt=0)
    commit_refresh: StrictBool | None = None
    """Refresh each block's KV at its commit (default: the server's ``--commit-refresh``); a
    JSON boolean, not a string."""
    ignore_eos: bool = False
    """Generate until the token limit, past the model's end-of-sequence tokens (benchmarks)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        strings = (value,) if isinstance(value, str) else value
        if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
            raise ValueError("stop must be a string or a list of strings")
        if len(strings) > MAX_STOP_STRINGS or not all(strings):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return tuple(strings)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_tokens(self) -> int | None:
        """The token limit the client asked for (``max_completion_tokens`` wins)."""
        return self.max_completion_tokens or self.max_tokens

    def reject_unsupported(self) -> None:
        """Raise the 400 for a parameter this server does not implement."""
        if self.n not in (None, 1):
            raise unsupported("n", f"n={self.n} (several choices per request)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, name)
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """The engine's parameters for this request. Without a seed a request draws a fresh one,
        so that unseeded sampled requests differ (as OpenAI's do)."""
        seed = self.seed if self.seed is not None else secrets.randbelow(2**32)
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, threshold=self.threshold, alpha=self.alpha, seed=seed,
            commit_refresh=self.commit_refresh, stop_token_ids=() if self.ignore_eos else None)


class CompletionRequest(RequestBody):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt)."""

    prompt: str | tuple[int, ...]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | tuple[int, ...]:
        return _prompt(value)

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.logprobs is not None:
            raise unsupported("logprobs", "logprobs")
        if self.echo:
            raise unsupported("echo", "echo")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}")
        if self.suffix:
            raise unsupported("suffix", "suffix")


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, (str, list)) for v in value):  # a batch of prompts
            if len(value) != 1:
                raise ValueError(f"one prompt per request, got {len(value)}: send several requests")
            return _prompt(value[0])
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
    raise ValueError("prompt must be a string or a non-empty list of token ids")


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        """The message's text (text parts joined); other parts are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise invalid(f"messages.{index}.content: only text parts are supported",
                          param="messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(RequestBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.logprobs or self.top_logprobs is not None:
            raise unsupported("logprobs", "logprobs")
        if self.tools:
            raise unsupported("tools", "tools (function calling)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", f"response_format {self.response_format.get('type')!r}")

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (``developer`` is a ``system`` message)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(self.messages)]
