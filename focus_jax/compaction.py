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


def bucket_ladder(total: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """Sorted distinct bucket sizes ``ceil(total * f)``; the last one is always ``total``."""
    sizes = {max(1, math.ceil(total * f)) for f in fractions} | {total}
    return tuple(sorted(s for s in sizes if s <= total))


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


def run_bucketed(ladder: Sequence[int], count: Int[Array, ""],
                 work: Callable[..., Any], *operands: Any) -> tuple[Int[Array, ""], Any]:
    """Run ``work(size, *operands)`` for the smallest bucket holding ``count``; returns the bucket's
    index and ``work``'s result (which must have the same shape for every size)."""
    index = bucket_index(count, ladder)
    branches = [lambda *ops, size=size: work(size, *ops) for size in ladder]
    return index, jax.lax.switch(index, branches, *operands)
