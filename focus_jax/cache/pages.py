"""The page pool on the host: which pages of a paged KV cache are free, which requests hold
which, and the prefix table of committed prompt blocks.

A request holds its pages until its end, counted by reference: a page of a cached prompt prefix
may be held by several requests at once. Pages can be **reserved** (a count, no page chosen):
a request reserves its worst case when admitted and takes pages out of its reservation as its
blocks come, so that it never waits for a page once running. A prompt block whose KV has been written
(prefilled) can be **registered** under its hash, a chain over the block's tokens and its
parent block's hash (:func:`block_hashes`), so that a later request whose prompt starts with the
same blocks reads their pages instead of computing them again. A registered page nobody holds
stays cached until the pool needs it: such pages are reclaimed least recently released first.
Only prompt blocks are registered: a generated block's KV depends on the path that decoded it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


def block_hashes(prompt: Sequence[int], block_size: int) -> list[bytes]:
    """The hash chain of the prompt's whole blocks: entry ``i`` identifies blocks ``0..i``
    (block ``i``'s tokens and entry ``i - 1``)."""
    hashes, parent = [], b""
    for start in range(0, len(prompt) - block_size + 1, block_size):
        tokens = np.asarray(prompt[start:start + block_size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PagePool:
    """``total`` pages; each is free, held by requests (a reference count), or cached (a
    registered prompt block nobody holds, reclaimable); ``reserved`` of the free and cached ones
    are promised to running requests.

    Invariants (:meth:`check`): every page is in exactly one of the three states; a held page's
    count is its holders; a registered page is listed under exactly one hash; no more pages are
    reserved than are free or cached.
    """

    def __init__(self, total: int, first: int = 0):
        if total < 1:
            raise ValueError(f"a page pool needs at least one page, got {total}")
        self.total, self.first = total, first
        """Its pages are ``first .. first + total - 1`` (a data shard's part of a pool)."""
        self._free: collections.deque[int] = collections.deque(range(first, first + total))
        self._holders: dict[int, int] = {}
        """page -> requests holding it (only pages held by at least one)."""
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Registered pages nobody holds, least recently released first."""
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.reserved = 0
        """Pages promised to requests (:meth:`reserve`), not yet taken."""

    @property
    def held(self) -> int:
        """Pages some request holds."""
        return len(self._holders)

    @property
    def available(self) -> int:
        """Pages a request could take or reserve now: free ones and cached ones nobody holds,
        less those reserved."""
        return len(self._free) + len(self._cached) - self.reserved

    @property
    def cached(self) -> int:
        """Registered pages (held or not)."""
        return len(self._page_of)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of leading blocks registered under ``hashes``."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_take(self, count: int, shared: Sequence[int] = ()) -> bool:
        """Whether ``count`` new pages can be taken once the pages ``shared`` are held (cached
        ones among them are then no longer reclaimable)."""
        reclaimable_shared = sum(page in self._cached for page in shared)
        return count <= self.available - reclaimable_shared

    def take(self, count: int, shared: Sequence[int] = (), reserve: int = 0) -> list[int]:
        """Hold the pages ``shared`` (registered pages from :meth:`match`) and ``count`` new
        ones, returned after them: free pages first, then cached ones least recently released
        first (they leave the prefix table); and reserve ``reserve`` more. ``RuntimeError`` if
        there are not enough."""
        if not self.can_take(count + reserve, shared):
            raise RuntimeError(f"{count + reserve} pages wanted, {self.available} available")
        for page in shared:
            self._hold(page)
        self.reserved += reserve
        return [*shared, *self._new_pages(count)]

    def take_reserved(self, count: int) -> list[int]:
        """Hold ``count`` new pages out of the reservation."""
        if not 0 <= count <= self.reserved:
            raise RuntimeError(f"{count} reserved pages wanted, {self.reserved} reserved")
        self.reserved -= count
        return self._new_pages(count)

    def unreserve(self, count: int) -> None:
        """Give back ``count`` reserved pages that were not taken."""
        if not 0 <= count <= self.reserved:
            raise RuntimeError(f"{count} pages to unreserve, {self.reserved} reserved")
        self.reserved -= count

    def _new_pages(self, count: int) -> list[int]:
        taken = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._holders[page] = 1
            taken.append(page)
        return taken

    def _hold(self, page: int) -> None:
        if page in self._cached:
            del self._cached[page]
        elif page not in self._holders:
            raise RuntimeError(f"page {page} is neither held nor cached")
        self._holders[page] = self._holders.get(page, 0) + 1

    def register(self, pages: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Register each held page of a request's prompt blocks under its hash (pairs in order;
        a hash already registered keeps its page). Returns how many were new."""
        new = 0
        for page, h in zip(pages, hashes, strict=False):
            if h in self._page_of or page in self._hash_of:
                continue
            if page not in self._holders:
                raise RuntimeError(f"page {page} is not held: only written pages are registered")
            self._page_of[h], self._hash_of[page] = page, h
            new += 1
        return new

    def release(self, pages: Sequence[int]) -> None:
        """A request lets go of its pages: a page nobody holds any more becomes cached if it is
        registered (most recently released), else free."""
        for page in pages:
            count = self._holders[page] - 1
            if count:
                self._holders[page] = count
                continue
            del self._holders[page]
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def check(self) -> None:
        """Raise ``AssertionError`` if an invariant does not hold (tests)."""
        free, held, cached = set(self._free), set(self._holders), set(self._cached)
        assert len(free) == len(self._free), "a page is free twice"
        assert not (free & held or free & cached or held & cached), "a page in two states"
        assert free | held | cached == set(range(self.first, self.first + self.total)), "a page lost"
        assert all(count >= 1 for count in self._holders.values())
        assert set(self._hash_of) == set(self._page_of.values()) and cached <= set(self._hash_of)
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())
        assert 0 <= self.reserved <= len(free) + len(cached), "more reserved than there are"


def _summed(count: str) -> property:
    """A :class:`ShardedPool` count: the sum of its shards' ``count``."""
    return property(lambda self: sum(getattr(pool, count) for pool in self.shards),
                    doc=f"The shards' {count} pages, summed.")


class ShardedPool:
    """The pages of a paged cache as ``pools``, one per data shard, over consecutive ranges of
    page ids: a slot of shard ``d`` only ever holds pages of ``pools[d]`` (:meth:`shard`), so
    each shard's pages live on its own devices (and a shard's prefix table is its own). The
    counts are the shards' sums."""

    def __init__(self, pools: Sequence[PagePool]):
        self.shards = list(pools)

    @classmethod
    def split(cls, total: int, shards: int = 1) -> ShardedPool:
        """``total`` pages split evenly over ``shards`` data shards."""
        if shards < 1 or total % shards:
            raise ValueError(f"{total} pages do not split evenly over {shards} data shards")
        each = total // shards
        return cls([PagePool(each, first=d * each) for d in range(shards)])

    def shard(self, index: int) -> PagePool:
        return self.shards[index]

    @property
    def shard_total(self) -> int:
        """Pages of one shard: the most one request can ever hold."""
        return self.shards[0].total

    total = _summed("total")
    held = _summed("held")
    available = _summed("available")
    reserved = _summed("reserved")
    cached = _summed("cached")

    def check(self) -> None:
        for pool in self.shards:
            pool.check()
