"""One request's run through the engine, as both endpoints need it.

Admission (the engine's refusals become 400, 429 and 503), the text of each committed block with
stop strings cut, the end (finish reason and usage), the client going away (the request is
aborted and its slot freed), and the request's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

from starlette.types import Receive

from focus_jax.engine import AsyncEngine, EngineClosed, QueueFull, RequestError, RequestOutput, SamplingParams
from focus_jax.serve.errors import APIError, internal, invalid, queue_full, unavailable
from focus_jax.serve.metrics import ServerMetrics
from focus_jax.serve.stop import StopText, tokens_through


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclasses.dataclass
class Piece:
    """Text to send; the last piece of a request also says how it ended."""

    text: str
    finish_reason: str | None = None
    """``stop`` or ``length`` on the last piece of a finished request."""
    usage: dict[str, int] | None = None
    """On the last piece of a finished request."""
    error: APIError | None = None
    """On the last piece of a request that ended without finishing (server shutting down, engine
    failure)."""


class Generation:
    """A request on its way through ``engine``: :meth:`start`, then :meth:`pieces`."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, tokenizer: Any,
                 prompt_ids: Sequence[int], params: SamplingParams, stops: Sequence[str] = ()):
        self.engine, self.metrics, self.tokenizer = engine, metrics, tokenizer
        self.block_size = engine.engine.block_size
        self.prompt_ids, self.params = list(prompt_ids), params
        self.text = StopText(stops)
        self.arrival = time.perf_counter()
        self._outputs: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._recorded = False
        self._first_block_seen = False

    async def start(self) -> None:
        """Hand the request to the engine and wait for its first output. Raises :class:`APIError`
        when the engine refuses it (invalid, queue full, shutting down)."""
        self._outputs = self.engine.generate(self.prompt_ids, self.params)
        try:
            self._first = await anext(self._outputs)
        except RequestError as err:
            self._record("invalid")
            raise invalid(str(err)) from None
        except QueueFull as err:
            self._record("rejected")
            raise queue_full(str(err)) from None
        except EngineClosed as err:
            self._record("rejected")
            raise unavailable(str(err)) from None
        except asyncio.CancelledError:
            self._record("abort")
            raise

    async def pieces(self) -> AsyncIterator[Piece]:
        """The request's text, a piece per committed block, up to its end. Closing this early
        (the client went away) aborts the request."""
        if self._outputs is None or self._first is None:
            raise RuntimeError("start() the generation first")
        out, outcome, tokens = self._first, "abort", None
        try:
            while True:
                if out.new_token_ids and not self._first_block_seen:
                    self._first_block_seen = True
                    self.metrics.first_block.observe(time.perf_counter() - self.arrival)
                for piece in self._pieces_of(out):
                    yield piece
                    if piece.error is not None:
                        outcome = out.finish_reason or "error"
                        return
                    if piece.finish_reason is not None:
                        outcome, tokens = piece.finish_reason, piece.usage["completion_tokens"]
                        return
                try:
                    out = await anext(self._outputs)
                except EngineClosed as err:  # the engine's loop failed
                    outcome = "error"
                    yield Piece("", error=internal(str(err)))
                    return
        finally:
            # Ends the engine's request if it has not finished (stop string, client gone).
            await self._outputs.aclose()
            self._record(outcome, out, len(out.token_ids) if tokens is None else tokens)

    def _pieces_of(self, out: RequestOutput) -> list[Piece]:
        """The pieces of one output: a piece per block it committed, the last one ending the
        request when the output or a stop string does."""
        if out.finished and out.finish_reason not in ("stop", "length"):
            return [Piece("", error=_ended_early(out))]
        pieces = []
        texts = self._block_texts(out)
        for i, text in enumerate(texts):
            final = out.finished and i == len(texts) - 1
            piece = self.text.feed(text, final=final)
            if self.text.stopped_at is not None:
                tokens = tokens_through(self.tokenizer, out.token_ids,
                                        self.text.stopped_at + len(self.text.stop))
                return [*pieces, Piece(piece, "stop", self._usage(tokens))]
            if final:
                return [*pieces, Piece(piece, out.finish_reason, self._usage(len(out.token_ids)))]
            if piece:
                pieces.append(Piece(piece))
        return pieces

    async def complete(self) -> tuple[str, Piece]:
        """The whole text and the last piece (non-streaming answers)."""
        parts = []
        async with contextlib.aclosing(self.pieces()) as pieces:
            async for piece in pieces:
                parts.append(piece.text)
        return "".join(parts), piece

    def _block_texts(self, out: RequestOutput) -> list[str]:
        """The request's text at the end of each block ``out`` committed (a decode round can
        commit several), the last being ``out.text``: a piece per block."""
        start = len(out.token_ids) - len(out.new_token_ids)
        prompt = len(self.prompt_ids)
        ends = [end for end in range(start + 1, len(out.token_ids))
                if (prompt + end) % self.block_size == 0]
        return [self.tokenizer.decode(out.token_ids[:end], skip_special_tokens=True)
                for end in ends] + [out.text or ""]

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def _record(self, outcome: str, out: RequestOutput | None = None, tokens: int = 0) -> None:
        """Count the request once, however it ended."""
        if self._recorded:
            return
        self._recorded = True
        if outcome in ("invalid", "rejected"):
            self.metrics.refused(outcome)
        else:
            self.metrics.finished(outcome, out, tokens, time.perf_counter() - self.arrival)


def _ended_early(out: RequestOutput) -> APIError:
    if out.finish_reason == "error":
        return internal(f"the engine failed this request: {out.error}")
    return unavailable("the server is shutting down: the request was aborted before it finished")


async def unless_disconnected[T](receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (which
    aborts its request) and :class:`ClientGone` is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)  # let the abort run
        raise ClientGone
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
