"""Static-shape bucketed compaction.

XLA compiles one program per shape, yet the number of tokens worth computing changes every step.
The kept rows of a flat token axis of length ``T`` are moved to the front of an index vector; the
smallest bucket of a static ladder that holds them is picked on the device, and ``lax.switch`` runs
the work compiled for that bucket. Rows past the count are padding: callers mask them out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def bucket_ladder(total: int, fractions: Sequence[float], minimum: int = 1) -> tuple[int, ...]:
    """Sorted distinct bucket sizes ``ceil(total * f)``, none below ``minimum`` rows (nor above
    ``total``); the last one is always ``total``."""
    sizes = {min(total, max(minimum, math.ceil(total * f))) for f in fractions} | {total}
    return tuple(sorted(sizes))


def compact(keep: Bool[Array, "t"]) -> tuple[Int[Array, "t"], Int[Array, ""]]:
    """Stable compaction: the kept indices first (in order), then the others; and their count."""
    keep = keep.astype(jnp.int32)
    count = keep.sum()
    kept_rank = jnp.cumsum(keep) - 1
    dropped_rank = count + jnp.cumsum(1 - keep) - 1
    destination = jnp.where(keep == 1, kept_rank, dropped_rank)
    rows = jnp.zeros_like(keep).at[destination].set(jnp.arange(keep.shape[0], dtype=jnp.int32))
    return rows, count


def bucket_index(count: Int[Array, ""], ladder: Sequence[int]) -> Int[Array, ""]:
    """Index of the smallest bucket that holds ``count`` rows."""
    return jnp.sum(jnp.asarray(ladder, jnp.int32) < count).astype(jnp.int32)


class Compaction:
    """The kept rows of a flat token axis, and the bucket of ``ladder`` they run in.

    ``rows`` orders the whole axis kept rows first: arrays "in compact order" are indexed like
    ``rows``, so a bucket's rows are their first ``size`` entries (a static slice), and
    ``inverse`` takes them back to the flat order. :meth:`run` calls ``work(rows, valid,
    *operands)`` with the first ``size`` row indices of the chosen bucket and their validity mask
    (padding rows are False); every bucket's ``work`` must return the same shapes. The same
    compaction can run several times (once per layer, say) and always picks the same bucket.
    """

    def __init__(self, keep: Bool[Array, "t"], ladder: Sequence[int]):
        self.rows, self.count = compact(keep)
        self.inverse = jnp.zeros_like(self.rows).at[self.rows].set(
            jnp.arange(keep.shape[0], dtype=self.rows.dtype))
        """Where each row of the flat axis sits in compact order."""
        self.kept_in_order = jnp.arange(keep.shape[0]) < self.count
        """Compact order: True for the kept rows (the first ``count``)."""
        self.ladder = tuple(ladder)
        self.index = bucket_index(self.count, self.ladder)

    @property
    def size(self) -> Int[Array, ""]:
        """Rows of the chosen bucket."""
        return jnp.asarray(self.ladder, jnp.int32)[self.index]

    def to_flat(self, compact_order: Array) -> Array:
        """An array in compact order, back in the flat order of the axis."""
        return compact_order[self.inverse]

    def run(self, work: Callable[..., Any], *operands: Any) -> Any:
        def branch(size: int) -> Callable[..., Any]:
            return lambda *ops: work(self.rows[:size], self.kept_in_order[:size], *ops)

        return jax.lax.switch(self.index, [branch(size) for size in self.ladder], *operands)

    def run_in_place(self, work: Callable[..., Any], carry: Any) -> Any:
        """Like :meth:`run` for ``work(rows, valid, carry) -> carry``, whose carry (a KV cache,
        say) is updated in place: one while loop per bucket, which runs once for the chosen bucket
        and not at all for the others. (A switch would give every branch its own output buffers,
        a copy of the carry.) Inside ``shard_map`` the carry's initial values must vary over the
        same mesh axes as ``work``'s results (make them with ``zeros_like`` of the shard's data)."""
        for index, size in enumerate(self.ladder):
            def once(state, size=size):
                chosen, carry = state
                return (jnp.zeros_like(chosen),
                        work(self.rows[:size], self.kept_in_order[:size], carry))

            _, carry = jax.lax.while_loop(lambda state: state[0], once, (self.index == index, carry))
        return carry
