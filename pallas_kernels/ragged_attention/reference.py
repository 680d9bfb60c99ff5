"""Ragged attention, pure jnp: the ground truth every kernel is held to.

Queries are the compacted rows of a decode step: row ``n`` is the token at flat index
``rows[n] = slot * block_size + position_in_block``; rows with ``valid[n] = False`` are padding.
Each query attends, non-causally, to its slot's cached keys and values at positions
``[0, kv_len[slot])`` of layer ``layer`` (``kv_len >= 1`` for every slot that has valid rows).
This reference pads the queries back to one block per slot, which costs the same for any number
of rows; the kernels work on the compacted rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def ragged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                     k_cache: Float[Array, "layers s m kvh d"],
                     v_cache: Float[Array, "layers s m kvh d"], layer: Int[Array, ""] | int,
                     kv_len: Int[Array, "s"], *, block_size: int,
                     layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Attention of compacted query rows over their slots' caches; GQA, float32 softmax.

    Returns ``[n, h, d]`` in ``q.dtype``; padding rows hold unspecified finite values.
    ``layout``: the rows' :func:`slot_layout`, for kernels that launch over it (computed once by
    a caller that attends with the same rows in several layers; this reference ignores it).
    """
    _n, h, d = q.shape
    _, slots, positions, kvh, _ = k_cache.shape
    flat = slots * block_size
    target = jnp.where(valid, rows, flat)
    q_blocks = jnp.zeros((flat, h, d), q.dtype).at[target].set(q, mode="drop")
    q_blocks = q_blocks.reshape(slots, block_size, kvh, h // kvh, d)
    k = k_cache[layer]
    v = v_cache[layer]
    scores = jnp.einsum("sbkgd,smkd->skgbm", q_blocks, k, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    visible = jnp.arange(positions)[None, :] < kv_len[:, None]
    scores = jnp.where(visible[:, None, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("skgbm,smkd->sbkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(flat, h, d)[rows].astype(q.dtype)


# The GPU kernels' launch settings, measured on the H200 for the jax-triton kernel (docs/kernels.md,
# "Launch settings"; scripts/tune_attention.py): the best of 36 at 256 slots for a quarter and for
# all of the rows, at 512 and 1,024 cached positions; 1.2x to 1.9x faster than the first choice
# (128, 64, 4 warps, 2 stages). The Pallas Triton kernel starts from them.
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 32, 4, 3


class SlotLayout(NamedTuple):
    """Where each slot's compacted rows are, which the GPU kernels launch over
    (:func:`slot_layout`). It depends on the rows only, not on the layer: a caller that runs
    several layers on the same rows computes it once and passes it to every call (``layout=``),
    instead of each call deriving it again (a few small kernels per layer)."""

    first_row: Int[Array, "s"]
    """Every slot's first compacted row (rows are slot-major)."""
    row_count: Int[Array, "s"]
    """Every slot's compacted rows."""
    occupied: Int[Array, "o"]
    """The slots that have rows, in order, then ``slots`` (none) up to
    :func:`occupied_slots` entries."""


def occupied_slots(rows: int, slots: int) -> int:
    """The most slots that ``rows`` compacted rows can occupy: ``min(rows, slots)`` (at least
    1)."""
    return max(1, min(rows, slots))


def slot_layout(rows: Int[Array, "n"], valid: Bool[Array, "n"], slots: int,
                block_size: int) -> SlotLayout:
    """The :class:`SlotLayout` of ``n`` compacted rows over ``slots`` slots."""
    slot = jnp.where(valid, rows // block_size, slots)
    count = jnp.zeros((slots,), jnp.int32).at[slot].add(1, mode="drop")
    occupied = jnp.nonzero(count > 0, size=occupied_slots(rows.shape[0], slots),
                           fill_value=slots)[0]
    return SlotLayout(jnp.cumsum(count) - count, count, occupied.astype(jnp.int32))


def gpu_layout(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
               k_cache: Float[Array, "layers s m kvh d"], v_cache: Float[Array, "layers s m kvh d"],
               block_size: int, block_m: int, layout: SlotLayout | None = None,
               slots: int | None = None) -> tuple[int, SlotLayout, int]:
    """What the GPU kernels (grid: query tile, KV head, slot) derive from their arguments: the
    GQA group, the rows' :class:`SlotLayout` (``layout`` if given), and the query-tile height
    (the ``block_size * group`` query vectors of a slot, at most ``block_m`` and at least 16 at
    a time, a power of two). Raises ``ValueError`` for a cache dtype other than the queries'.
    ``slots``: the slot count, where the caches' axis 1 is not it (a paged pool's pages)."""
    group = q.shape[1] // k_cache.shape[3]
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        # Casting here would copy the whole cache (every layer) on every call.
        raise ValueError(f"ragged_attention: cache dtype {k_cache.dtype} differs from the "
                         f"queries' {q.dtype}")
    if layout is None:
        layout = slot_layout(rows, valid, k_cache.shape[1] if slots is None else slots,
                             block_size)
    vectors = block_size * group
    return group, layout, min(block_m, max(16, 1 << (vectors - 1).bit_length()))
