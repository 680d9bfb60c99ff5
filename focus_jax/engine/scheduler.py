"""The scheduler: the queue of waiting requests, which slot holds which request, admission and
abort. Host-side bookkeeping only; the runner does the device work it decides."""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Sequence

from focus_jax.cache.pages import PagePool, block_hashes
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
    pages: list[int] = dataclasses.field(default_factory=list)
    """The pages it holds in position order (a paged cache), until its end."""
    reserved: int = 0
    """Pages of its worst case it has reserved but not taken yet."""
    history: int = 0
    """Its positions whose KV is final, as the host last saw them (a multiple of B)."""
    cached_blocks: int = 0
    """Leading prompt blocks whose pages it shares from the prefix table (not prefilled)."""
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    """The hash chain of its prompt's whole blocks (with prefix caching)."""

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens


class Scheduler:
    """Requests in arrival order; admission fills free slots from the head of the queue.

    Every slot has the same KV capacity (``cache_len`` positions), so a request is admissible
    when its prompt and ``max_new_tokens`` fit one slot's cache: checked when it is added, and
    again when it is admitted. With a paged cache (``pool``) a request is admitted when the
    pages of its worst case (prompt and ``max_new_tokens``) can be reserved; the head of the
    queue waits for them (nothing behind it overtakes it), and a request that needs more pages
    than the pool has is refused when it is added. It takes the pages of its prompt and active
    block at admission and the others out of its reservation as its blocks come
    (:meth:`extend_pages`, before each round), and gives back both at its end. With
    ``prefix_caching`` its leading prompt blocks found in the pool's prefix table are shared,
    not taken afresh.
    """

    def __init__(self, slots: int, cache_len: int, block_size: int, pool: PagePool | None = None,
                 prefix_caching: bool = False):
        self.slots, self.cache_len, self.block_size = slots, cache_len, block_size
        self.pool, self.prefix_caching = pool, prefix_caching
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
        if self.pool is not None and need // self.block_size > self.pool.total:
            raise RequestError(
                f"prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} needs "
                f"{need // self.block_size} pages of {self.block_size} positions, but the KV "
                f"cache's pool has {self.pool.total}: shorten the prompt, lower max_new_tokens "
                f"or give the cache more memory")

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
            request = self.waiting[0]
            try:
                self.check_fits(len(request.prompt), request.max_new_tokens)
            except RequestError as err:
                refused.append((self.waiting.popleft(), err))
                continue
            if self.pool is not None and not self._take_pages(request):
                break  # it waits for pages, and so does everything behind it
            admitted.append(self.waiting.popleft())
        admitted.sort(key=lambda r: len(r.prompt))
        for request, slot in zip(admitted, free, strict=False):
            request.slot = slot
            self.running[slot] = request
        return admitted, refused

    def _take_pages(self, request: Request) -> bool:
        """Reserve the pages of the request's worst case, sharing its cached prompt blocks and
        taking the pages of its prompt's blocks and its active block; False (nothing taken) if
        the pool cannot give them now."""
        worst = self._worst_case(request)
        if self.prefix_caching and not request.block_hashes:
            request.block_hashes = block_hashes(request.prompt, self.block_size)
        shared = self.pool.match(request.block_hashes) if self.prefix_caching else []
        history = len(request.prompt) // self.block_size
        now = min(worst, history + 1) - len(shared)
        if not self.pool.can_take(worst - len(shared), shared):
            return False
        request.pages = self.pool.take(now, shared, reserve=worst - len(shared) - now)
        request.reserved = worst - len(request.pages)
        request.cached_blocks = len(shared)
        request.history = history * self.block_size
        return True

    def _worst_case(self, request: Request) -> int:
        """Pages of a request's prompt and ``max_new_tokens``."""
        return self.positions_needed(len(request.prompt), request.max_new_tokens) // self.block_size

    def extend_pages(self, steps: int) -> list[Request]:
        """Before a round of at most ``steps`` steps (a paged cache): every running request
        takes, out of its reservation, the pages of the blocks the round can reach (one block
        committed per step at most, from ``Request.history``). Returns those whose pages
        grew."""
        grown = []
        for request in self.running.values():
            want = min(self._worst_case(request), request.history // self.block_size + steps + 1)
            more = want - len(request.pages)
            if more > 0:
                request.pages += self.pool.take_reserved(more)
                request.reserved -= more
                grown.append(request)
        return grown

    def register_prompt(self, request: Request) -> None:
        """With prefix caching: the request's prompt blocks have been prefilled (the programs
        that write them are queued before any that could read them), so later requests may
        share their pages."""
        if self.prefix_caching:
            self.pool.register(request.pages, request.block_hashes)

    def finish(self, request: Request) -> None:
        """Free the request's slot and its pages."""
        if request.slot is not None and self.running.get(request.slot) is request:
            del self.running[request.slot]
        request.slot = None
        if self.pool is not None:
            self.pool.release(request.pages)
            self.pool.unreserve(request.reserved)
            request.pages, request.reserved = [], 0

    def batches(self, admitted: Sequence[Request], size: int) -> list[list[Request]]:
        """Prefill batches of at most ``size`` admitted requests."""
        return [list(admitted[i:i + size]) for i in range(0, len(admitted), size)]
