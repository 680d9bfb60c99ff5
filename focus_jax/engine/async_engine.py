"""An asynchronous front for servers: the engine's step loop on a background thread.

``async for out in engine.generate(prompt_ids, params)`` yields each committed block of one
request. Requests and aborts reach the loop through an inbox (the loop owns the engine; no
lock is held while the device works), outputs come back to each consumer's event loop. An
engine with ``interruptible_rounds`` has its running round end at the next step when a request
arrives that a free slot can take, or an abort frees a slot that a waiting request needs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from focus_jax.engine.core import Engine
from focus_jax.engine.output import RequestOutput
from focus_jax.engine.params import RequestError, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """``max_queue`` requests already wait; try again later."""


class EngineClosed(RuntimeError):
    """The engine is shutting down (or its loop failed) and takes no new requests."""


class _Stream:
    """Where one request's outputs go: an asyncio queue on its consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` over; False when the consumer's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop was closed
            return False
        return True


class AsyncEngine:
    """Runs ``engine`` on a background thread; many coroutines submit and stream at once.

    ``max_queue``: at most this many requests wait for a slot (:class:`QueueFull` beyond it);
    running requests do not count (``slots`` running and ``max_queue`` waiting are taken).
    ``step_listeners``: callables ``(outputs, engine)`` run on the loop's thread after every
    step (metrics).
    """

    def __init__(self, engine: Engine, *, max_queue: int | None = None,
                 idle_poll_seconds: float = 0.1):
        self.engine = engine
        self.max_queue = max_queue
        self.step_listeners: list[Callable[[list[RequestOutput], Engine], None]] = []
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._submitted = 0
        """Requests handed to the inbox and not yet finished (read by :meth:`generate`)."""
        self._closing = False
        self._deadline: float | None = None
        self._failure: BaseException | None = None
        self._idle_poll = idle_poll_seconds
        self.num_waiting = 0
        self.num_running = 0
        self._thread = threading.Thread(target=self._loop, name="focus-jax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- consumers
    async def generate(self, prompt: Sequence[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as its blocks commit; the last has ``finished=True`` (its
        ``finish_reason`` says why, ``error`` when it failed). Leaving the loop early (break,
        cancellation) aborts the request: its slot is free at the next step (use
        ``contextlib.aclosing`` to have that happen at once rather than when the generator is
        collected). Raises :class:`RequestError` for a request that cannot be served,
        :class:`QueueFull` and :class:`EngineClosed` when it cannot be taken now."""
        if self._closing or self._failure is not None:
            raise EngineClosed("the engine is shutting down" if self._failure is None
                               else f"the engine failed: {self._failure}")
        ids, resolved = self.engine.validate(prompt, params)
        with self._id_lock:
            if self.max_queue is not None and self.queued >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests already wait for a slot")
            rid = next(self._ids)
            self._submitted += 1
        stream = _Stream(asyncio.get_running_loop())
        self._inbox.put(("add", rid, ids, resolved, stream))
        self._wake.set()
        if self._submitted <= self.engine.slots:  # a slot is free for it: take it in at once
            self._interrupt_round()
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    @property
    def queued(self) -> int:
        """Requests taken and not finished beyond the engine's slots: those that wait for a
        slot. (A request taken while a slot is free counts as running: the next step admits
        it, whether or not the loop has read it yet.)"""
        return max(0, self._submitted - self.engine.slots)

    def abort(self, request_id: int) -> None:
        """End a request (its consumer gets a last output with ``finish_reason="abort"``)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()
        if self._submitted > self.engine.slots:  # requests wait for the slot it frees
            self._interrupt_round()

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        """Stop taking requests; running and waiting ones may finish within ``grace_seconds``,
        then the rest are aborted. Returns within about ``grace_seconds`` plus one round."""
        self._closing = True
        self._deadline = time.monotonic() + grace_seconds
        self._wake.set()
        self._interrupt_round()
        await asyncio.to_thread(self._thread.join, grace_seconds + 30.0)
        if self._thread.is_alive():
            log.warning("the engine's loop did not stop within the grace period")

    @property
    def running(self) -> bool:
        """The step loop is alive."""
        return self._thread.is_alive()

    def _interrupt_round(self) -> None:
        """End the running round after its current step (interruptible rounds; otherwise the
        flag is never read)."""
        self.engine.round_interrupt.set()

    # ----------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        engine = self.engine
        while True:
            # Cleared before the inbox is read: what arrives later sets it for the next round.
            engine.round_interrupt.clear()
            self._drain_inbox()
            if self._closing and self._deadline is not None and time.monotonic() > self._deadline:
                self._abort_everything()
            if self._closing and not engine.has_unfinished() and self._inbox.empty():
                return
            if not engine.has_unfinished():
                self._wake.wait(self._idle_poll)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as err:  # the device program failed: nothing can go on
                log.exception("engine step failed")
                self._failure = err
                for stream in self._streams.values():
                    stream.put(EngineClosed(f"the engine failed: {type(err).__name__}: {err}"))
                self._streams.clear()
                return
            self.num_waiting, self.num_running = engine.num_waiting, engine.num_running
            self._deliver(outputs)
            for listener in self.step_listeners:
                try:
                    listener(outputs, engine)
                except Exception:
                    log.exception("step listener failed")

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, ids, params, stream = command
                try:
                    self.engine.add_request(ids, params, request_id=rid)
                except RequestError as err:
                    with self._id_lock:
                        self._submitted -= 1
                    stream.put(err)
                    continue
                self._streams[rid] = stream
            else:
                self.engine.abort(command[1])
        self.num_waiting, self.num_running = self.engine.num_waiting, self.engine.num_running

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                with self._id_lock:
                    self._submitted -= 1
            if stream is not None and not stream.put(out) and not out.finished:
                self.engine.abort(out.request_id)  # its consumer is gone

    def _abort_everything(self) -> None:
        for rid in list(self._streams):
            self.engine.abort(rid)
