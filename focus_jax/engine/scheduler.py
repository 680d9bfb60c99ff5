"""The scheduler: the queue of waiting requests, which slot holds which request, admission and
abort. Host-side bookkeeping only; the runner does the device work it decides."""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Sequence

from focus_jax.cache.pages import PagePool, ShardedPool, block_hashes
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

    def __init__(self, slots: int, cache_len: int, block_size: int,
                 pool: PagePool | ShardedPool | None = None, prefix_caching: bool = False):
        self.slots, self.cache_len, self.block_size = slots, cache_len, block_size
        self.pool = ShardedPool([pool]) if isinstance(pool, PagePool) else pool
        """A paged cache's pages; over several data shards, shard ``d`` serves the slots
        ``d * slots / shards`` onwards (the slots a data shard steps)."""
        self.prefix_caching = prefix_caching
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
        if self.pool is not None and need // self.block_size > self.pool.shard_total:
            shards = "" if len(self.pool.shards) == 1 else " per data shard (a slot's pages are its shard's)"
            raise RequestError(
                f"prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} needs "
                f"{need // self.block_size} pages of {self.block_size} positions, but the KV "
                f"cache's pool has {self.pool.shard_total}{shards}: shorten the prompt, lower "
                f"max_new_tokens or give the cache more memory")

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
        and the ones that cannot run, with the reason. With a paged cache a request goes to the
        data shard holding the longest run of its prompt blocks, else the one with the most
        pages available, among those with a free slot."""
        free = [slot for slot in range(self.slots) if slot not in self.running]
        open_slots = collections.Counter(self.shard(slot) for slot in free)
        admitted, refused, shard_of = [], [], {}
        while len(admitted) < len(free) and self.waiting:
            request = self.waiting[0]
            try:
                self.check_fits(len(request.prompt), request.max_new_tokens)
            except RequestError as err:
                refused.append((self.waiting.popleft(), err))
                continue
            if self.pool is not None:
                shard = self._take_pages(request, [d for d, n in open_slots.items() if n])
                if shard is None:
                    break  # it waits for pages, and so does everything behind it
                open_slots[shard] -= 1
                shard_of[request.rid] = shard
            admitted.append(self.waiting.popleft())
        admitted.sort(key=lambda r: len(r.prompt))
        for request in admitted:
            shard = shard_of.get(request.rid)
            request.slot = next(s for s in free if shard is None or self.shard(s) == shard)
            free.remove(request.slot)
            self.running[request.slot] = request
        return admitted, refused

    def shard(self, slot: int) -> int:
        """The data shard whose pages serve ``slot`` (0 without a paged cache)."""
        return 0 if self.pool is None else slot // (self.slots // len(self.pool.shards))

    def _take_pages(self, request: Request, shards: Sequence[int]) -> int | None:
        """Reserve the pages of the request's worst case in one of ``shards`` (data shards with a
        free slot), sharing its cached prompt blocks and taking the pages of its prompt's
        blocks and its active block; the shard, or None (nothing taken) if none can give them
        now."""
        worst = self._worst_case(request)
        if self.prefix_caching and not request.block_hashes:
            request.block_hashes = block_hashes(request.prompt, self.block_size)

        cached_in = {d: self.pool.shard(d).match(request.block_hashes)
                     if self.prefix_caching else [] for d in shards}
        history = len(request.prompt) // self.block_size
        for d in sorted(shards, key=lambda d: (len(cached_in[d]), self.pool.shard(d).available),
                        reverse=True):
            pool, cached = self.pool.shard(d), cached_in[d]
            if not pool.can_take(worst - len(cached), cached):
                continue
            now = min(worst, history + 1) - len(cached)
            request.pages = pool.take(now, cached, reserve=worst - len(cached) - now)
            request.reserved = worst - len(request.pages)
            request.cached_blocks = len(cached)
            request.history = history * self.block_size
            return d
        return None

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
                request.pages += self.pool.shard(self.shard(request.slot)).take_reserved(more)
                request.reserved -= more
                grown.append(request)
        return grown

    def register_prompt(self, request: Request) -> None:
        """With prefix caching: the request's prompt blocks have been prefilled (the programs
        that write them are queued before any that could read them), so later requests may
        share their pages."""
        if self.prefix_caching:
            self.pool.shard(self.shard(request.slot)).register(request.pages, request.block_hashes)

    def finish(self, request: Request) -> None:
        """Free the request's slot and its pages."""
        if request.slot is not None and self.running.get(request.slot) is request:
            del self.running[request.slot]
        if self.pool is not None and request.slot is not None:
            pool = self.pool.shard(self.shard(request.slot))
            pool.release(request.pages)
            pool.unreserve(request.reserved)
            request.pages, request.reserved = [], 0
        request.slot = None

    def batches(self, admitted: Sequence[Request], size: int) -> list[list[Request]]:
        """Prefill batches of at most ``size`` admitted requests."""
        return [list(admitted[i:i + size]) for i in range(0, len(admitted), size)]
