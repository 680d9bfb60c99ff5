"""The output processor: from a decode round's host copies to per-request outputs.

It turns each round's step logs into statistics (per request and for the run), hands every
request the tokens of the blocks it committed in the round, detokenises them incrementally and
builds the final :class:`Result` when a request ends.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from focus_jax import decoding


def token_layer_split(processed: float, retained: float, num_layers: int) -> tuple[float, float]:
    """Token-layers through layers 0-1 (every processed token) and through layers >= 2 (the
    retained ones), from token counts (or counts per step, or per generated token)."""
    return 2 * processed, (num_layers - 2) * retained


@dataclasses.dataclass
class RequestStats:
    """Per-request statistics. Lists hold one entry per denoising step (commit steps excluded);
    times are ``time.perf_counter()`` readings (None until they happen)."""

    steps: int = 0
    """All steps the request took part in, commit steps included."""
    decoded_per_step: list[int] = dataclasses.field(default_factory=list)
    processed_per_step: list[int] = dataclasses.field(default_factory=list)
    retained_per_step: list[int] = dataclasses.field(default_factory=list)
    processed_tokens: int = 0
    """Token-steps through layers 0-1 over all its steps, commit steps included."""
    retained_tokens: int = 0
    """Token-steps through layers >= 2 over all its steps, commit steps included."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV it shared from the prefix cache instead of prefilling them."""
    arrival_time: float | None = None
    admitted_time: float | None = None
    """When its prefill was done (it decodes from the next round on)."""
    first_block_time: float | None = None
    """When its first committed block reached the host."""
    finished_time: float | None = None

    @property
    def denoising_steps(self) -> int:
        return len(self.decoded_per_step)

    @property
    def mean_decoded_per_step(self) -> float:
        return float(np.mean(self.decoded_per_step)) if self.decoded_per_step else 0.0


@dataclasses.dataclass
class Result:
    """One finished request."""

    token_ids: list[int]
    text: str | None
    finish_reason: str
    """``stop`` (a stop token ended it), ``length`` (max_new_tokens reached), ``abort`` or
    ``error``."""
    prompt_tokens: int
    stats: RequestStats
    error: str | None = None


@dataclasses.dataclass
class RequestOutput:
    """What a request got from one engine step: the tokens of the blocks it committed, or its end."""

    request_id: int
    new_token_ids: list[int]
    """Tokens committed since this request's previous output."""
    token_ids: list[int]
    """Every returned token so far."""
    text: str | None
    """``token_ids`` detokenised (special tokens skipped); None without a tokenizer or when the
    engine does not detokenise."""
    new_text: str
    """The part of ``text`` that the previous output's text did not have."""
    finished: bool
    finish_reason: str | None
    """``stop``, ``length``, ``abort`` or ``error`` once finished; None while running."""
    error: str | None
    prompt_tokens: int
    stats: RequestStats

    def result(self) -> Result:
        """The :class:`Result` of a finished request."""
        return Result(token_ids=self.token_ids, text=self.text, finish_reason=self.finish_reason,
                      prompt_tokens=self.prompt_tokens, stats=self.stats, error=self.error)


@dataclasses.dataclass
class RunStats:
    """Statistics of everything the engine ran (all requests together)."""

    steps: int = 0
    rounds: int = 0
    generated_tokens: int = 0
    processed_tokens: int = 0
    """Token-steps through layers 0-1."""
    retained_tokens: int = 0
    """Token-steps through layers >= 2."""
    decoded_tokens: int = 0
    sampled_tokens: int = 0
    """Token-steps through the LM head."""
    processed_buckets: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Steps per bucket size (rows) of the processed-token compaction."""
    retained_buckets: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Steps per bucket size (rows) of the retained-token compaction."""
    wall_seconds: float = 0.0
    """Wall time of the engine's steps (idle time between them not counted)."""
    decode_seconds: float = 0.0
    """Wall time from handing a decode round to the device until its results are on the host."""
    prefill_seconds: float = 0.0
    """Wall time from handing prefills to the device until they are done."""
    host_seconds: float = 0.0
    """Wall time of host work between rounds (statistics, streaming, building prefill batches):
    the device has nothing queued then."""
    prompt_tokens: int = 0
    """Prompt tokens of the requests admitted."""
    cached_prompt_tokens: int = 0
    """Of those, the ones whose KV came from the prefix cache (shared pages)."""
    prefilled_tokens: int = 0
    """Prompt positions whose KV prefill computed and wrote (whole blocks not cached)."""
    kv_pages: int = 0
    """Pages of a paged KV cache's pool (0: the contiguous cache)."""
    kv_pages_peak: int = 0
    """The most pages requests held at once."""

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens reused from the prefix cache / prompt tokens."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @contextlib.contextmanager
    def timed(self, field: str) -> Iterator[None]:
        """Adds the wall time of the ``with`` block to ``<field>`` (one of the ``*_seconds``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, field, getattr(self, field) + time.perf_counter() - start)

    def token_layers(self, num_layers: int) -> int:
        """Token-layers computed: processed tokens through layers 0-1, retained through the rest."""
        return sum(token_layer_split(self.processed_tokens, self.retained_tokens, num_layers))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0


class OutputProcessor:
    """Statistics, incremental token hand-over and detokenisation.

    ``tokenizer``: detokenises outputs (None: ``text`` stays None); the text of a request is
    decoded whole each time it grows, so multi-byte characters split over blocks come out whole.
    """

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.stats = RunStats()

    def record_prefill(self, request: Any, block_size: int) -> None:
        """Count an admitted request's prompt: its tokens, those it shares from the prefix
        cache, and those prefill wrote."""
        cached = request.cached_blocks * block_size
        request.stats.cached_prompt_tokens = cached
        self.stats.prompt_tokens += len(request.prompt)
        self.stats.cached_prompt_tokens += cached
        self.stats.prefilled_tokens += len(request.prompt) // block_size * block_size - cached

    def record_round(self, results: decoding.RoundResults, requests: dict[int, Any]) -> None:
        """Add a round's step counts to the run's statistics and to each running request's
        (``requests``: slot -> request)."""
        steps = results.steps
        processed = results.processed[:steps]  # [steps, slots]
        retained = results.retained[:steps]
        decoded = results.decoded[:steps]
        stats = self.stats
        stats.rounds += 1
        stats.steps += steps
        stats.processed_tokens += int(processed.sum())
        stats.retained_tokens += int(retained.sum())
        stats.decoded_tokens += int(decoded.sum())
        stats.sampled_tokens += int(results.sampled[:steps].sum())
        stats.processed_buckets.update(results.processed_bucket[:steps].tolist())
        stats.retained_buckets.update(results.retained_bucket[:steps].tolist())
        for slot, request in requests.items():
            took_part = results.step_live[:steps, slot]
            denoising = took_part & (decoded[:, slot] > 0)
            rs = request.stats
            rs.steps += int(took_part.sum())
            rs.processed_tokens += int(processed[took_part, slot].sum())
            rs.retained_tokens += int(retained[took_part, slot].sum())
            rs.decoded_per_step += decoded[denoising, slot].tolist()
            rs.processed_per_step += processed[denoising, slot].tolist()
            rs.retained_per_step += retained[denoising, slot].tolist()

    def output(self, request: Any, ids: list[int], finish_reason: str | None = None,
               error: str | None = None) -> RequestOutput | None:
        """The output that hands ``request`` its returned tokens ``ids`` (all so far); None when
        nothing is new and it has not finished. Records the hand-over in ``request``."""
        finished = finish_reason is not None
        if len(ids) <= len(request.returned) and not finished:
            return None
        now = time.perf_counter()
        new_ids = ids[len(request.returned):]
        if new_ids and request.stats.first_block_time is None:
            request.stats.first_block_time = now
        text = request.text
        if self.tokenizer is not None and (new_ids or text is None):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        previous = request.text or ""
        new_text = text[len(previous):] if text is not None and text.startswith(previous) else (
            text or "")
        request.returned, request.text = list(ids), text
        if finished:
            request.stats.finished_time = now
            self.stats.generated_tokens += len(ids)
        return RequestOutput(request_id=request.rid, new_token_ids=new_ids, token_ids=list(ids),
                             text=text, new_text=new_text, finished=finished,
                             finish_reason=finish_reason, error=error,
                             prompt_tokens=len(request.prompt), stats=request.stats)
