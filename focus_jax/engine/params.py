"""Per-request parameters: what a request may choose for itself without recompiling anything."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from focus_jax.config import DEFAULT_THRESHOLD, GenerationConfig
from focus_jax.decoding import MAX_STOP_IDS, SlotParams


class RequestError(ValueError):
    """A request the engine cannot serve (the message says why); other requests go on."""


def _integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):  # "false" or 0 would read as a choice
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``None`` fields take the engine's defaults (its
    :class:`~focus_jax.config.GenerationConfig`). Validated on construction (:class:`RequestError`).

    A request's random draws depend on its ``seed`` and its own positions only: it samples the
    same tokens in any slot and any batch.
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    """0: greedy."""
    top_k: int | None = None
    """0: no limit."""
    top_p: float | None = None
    """In (0, 1]."""
    threshold: float | None = None
    """Confidence threshold of the unmasking rule (default: the mode's, focus 0.8, others 0.9)."""
    alpha: float | None = None
    """FOCUS budget factor."""
    stop_token_ids: tuple[int, ...] | None = None
    """At most 8 (None: the model's EOS ids); the stop token itself is not returned."""
    seed: int | None = None
    commit_refresh: bool | None = None
    """Refresh each block's KV at its commit step (``GenerationConfig.commit_refresh``)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            _integer("max_new_tokens", self.max_new_tokens, 1)
        if self.temperature is not None and _real("temperature", self.temperature) < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None:
            _integer("top_k", self.top_k, 0)
        if self.top_p is not None and not 0.0 < _real("top_p", self.top_p) <= 1.0:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.threshold is not None and not 0.0 <= _real("threshold", self.threshold) <= 1.0:
            raise RequestError(f"threshold must lie in [0, 1], got {self.threshold}")
        if self.alpha is not None and _real("alpha", self.alpha) <= 0:
            raise RequestError(f"alpha must be > 0, got {self.alpha}")
        if self.seed is not None and not 0 <= _integer("seed", self.seed, 0) < 2**32:
            raise RequestError(f"seed must lie in [0, 2**32), got {self.seed}")
        if self.commit_refresh is not None:
            object.__setattr__(self, "commit_refresh", _boolean("commit_refresh",
                                                                self.commit_refresh))
        if self.stop_token_ids is not None:
            ids = tuple(_integer("stop token id", t, 0) for t in self.stop_token_ids)
            if len(ids) > MAX_STOP_IDS:
                raise RequestError(f"at most {MAX_STOP_IDS} stop token ids per request, got "
                                   f"{len(ids)}")
            object.__setattr__(self, "stop_token_ids", ids)

    @classmethod
    def from_config(cls, config: GenerationConfig, **changes: object) -> SamplingParams:
        """The parameters ``config`` names (its ``None`` fields stay engine defaults)."""
        fields = dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                      top_k=config.top_k, top_p=config.top_p, threshold=config.threshold,
                      alpha=config.alpha, stop_token_ids=config.stop_token_ids, seed=config.seed,
                      commit_refresh=config.commit_refresh)
        return cls(**(fields | changes))

    def resolved(self, config: GenerationConfig, stop_token_ids: Sequence[int]) -> SamplingParams:
        """Every field set: ``None`` ones from ``config`` (and the model's ``stop_token_ids``)."""
        def pick(mine, default):
            return default if mine is None else mine

        stops = self.stop_token_ids if self.stop_token_ids is not None else (
            config.stop_token_ids if config.stop_token_ids is not None else tuple(stop_token_ids))
        return SamplingParams(
            max_new_tokens=pick(self.max_new_tokens, config.max_new_tokens),
            temperature=pick(self.temperature, config.temperature),
            top_k=pick(self.top_k, config.top_k), top_p=pick(self.top_p, config.top_p),
            threshold=pick(self.threshold, pick(config.threshold, DEFAULT_THRESHOLD[config.mode])),
            alpha=pick(self.alpha, config.alpha), stop_token_ids=tuple(stops),
            seed=pick(self.seed, config.seed),
            commit_refresh=pick(self.commit_refresh, config.commit_refresh))


def slot_params_rows(params: Sequence[SamplingParams], rows: int) -> SlotParams:
    """Host arrays of ``rows`` rows of :class:`~focus_jax.decoding.SlotParams`: the resolved
    ``params`` first, then padding rows."""
    def column(name: str, dtype, pad) -> np.ndarray:
        values = [getattr(p, name) for p in params]
        return np.asarray(values + [pad] * (rows - len(values)), dtype)

    stop_ids = np.full((rows, MAX_STOP_IDS), -1, np.int32)
    for row, p in enumerate(params):
        stop_ids[row, :len(p.stop_token_ids)] = p.stop_token_ids
    return SlotParams(
        max_new=column("max_new_tokens", np.int32, 0),
        temperature=column("temperature", np.float32, 0.0),
        top_k=column("top_k", np.int32, 0), top_p=column("top_p", np.float32, 1.0),
        threshold=column("threshold", np.float32, 1.0), alpha=column("alpha", np.float32, 1.0),
        stop_ids=stop_ids, seed=column("seed", np.uint32, 0),
        commit_refresh=column("commit_refresh", bool, False))
