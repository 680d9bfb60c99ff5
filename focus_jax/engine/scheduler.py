"""The scheduler: the queue of waiting requests, which slot holds which request, admission and
abort. Host-side bookkeeping only; the runner does the device work it decides."""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Sequence

from focus_jax.engine.output import RequestStats
from focus_jax.engine.params import RequestError, SamplingParams


@dataclasses.dataclass
class Request:
    """A request the engine knows: waiting, or running in ``slot``."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    """Every field resolved."""
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    slot: int | None = None
    returned: list[int] = dataclasses.field(default_factory=list)
    """Tokens handed out so far."""
    text: str | None = None
    """``returned`` detokenised."""

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens


class Scheduler:
    """Requests in arrival order; admission fills free slots from the head of the queue.

    Every slot has the same KV capacity (``cache_len`` positions), so a request is admissible
    when its prompt and ``max_new_tokens`` fit one slot's cache: checked when it is added, and
    again when it is admitted.
    """

    def __init__(self, slots: int, cache_len: int, block_size: int):
        self.slots, self.cache_len, self.block_size = slots, cache_len, block_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}
        """slot -> request."""
        self._aborted: set[int] = set()

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a request needs: its prompt and generated blocks, rounded up to B."""
        return math.ceil((prompt_len + max_new_tokens) / self.block_size) * self.block_size

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`RequestError` if a request cannot fit a slot's cache."""
        need = self.positions_needed(prompt_len, max_new_tokens)
        if need > self.cache_len:
            raise RequestError(
                f"prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} needs {need} "
                f"cache positions, but the cache holds {self.cache_len}: shorten the prompt, lower "
                f"max_new_tokens or raise the cache length")

    def add(self, request: Request, arrival_time: float | None = None) -> None:
        self.check_fits(len(request.prompt), request.max_new_tokens)
        request.stats.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.waiting.append(request)

    def abort(self, rid: int) -> Request | None:
        """Remove a waiting request (returned), or mark a running one for release at the next
        step (see :meth:`take_aborted`). Unknown or finished ids are ignored."""
        for request in self.waiting:
            if request.rid == rid:
                self.waiting.remove(request)
                return request
        if any(r.rid == rid for r in self.running.values()):
            self._aborted.add(rid)
        return None

    def take_aborted(self) -> list[Request]:
        """The running requests aborted since the last call (still in their slots: the caller
        releases them and calls :meth:`finish`)."""
        aborted = [r for r in self.running.values() if r.rid in self._aborted]
        self._aborted.clear()
        return aborted

    def admit(self) -> tuple[list[Request], list[tuple[Request, RequestError]]]:
        """Move waiting requests into free slots, in queue order. Returns the admitted ones
        (shortest prompt first, so that prefill batches pad to lengths close to their members')
        and the ones that cannot run, with the reason."""
        free = [slot for slot in range(self.slots) if slot not in self.running]
        admitted, refused = [], []
        while len(admitted) < len(free) and self.waiting:
            request = self.waiting.popleft()
            try:
                self.check_fits(len(request.prompt), request.max_new_tokens)
            except RequestError as err:
                refused.append((request, err))
                continue
            admitted.append(request)
        admitted.sort(key=lambda r: len(r.prompt))
        for request, slot in zip(admitted, free, strict=False):
            request.slot = slot
            self.running[slot] = request
        return admitted, refused

    def finish(self, request: Request) -> None:
        """Free the request's slot."""
        if request.slot is not None and self.running.get(request.slot) is request:
            del self.running[request.slot]
        request.slot = None

    def batches(self, admitted: Sequence[Request], size: int) -> list[list[Request]]:
        """Prefill batches of at most ``size`` admitted requests."""
        return [list(admitted[i:i + size]) for i in range(0, len(admitted), size)]
