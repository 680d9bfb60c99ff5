"""Ragged attention, pure jnp: the ground truth every kernel is held to.

Queries are the compacted rows of a decode step: row ``n`` is the token at flat index
``rows[n] = slot * block_size + position_in_block``; rows with ``valid[n] = False`` are padding.
Each query attends, non-causally, to its slot's cached keys and values at positions
``[0, kv_len[slot])`` of layer ``layer`` (``kv_len >= 1`` for every slot that has valid rows).
This reference pads the queries back to one block per slot, which costs the same for any number
of rows; the kernels work on the compacted rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def ragged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                     k_cache: Float[Array, "layers s m kvh d"],
                     v_cache: Float[Array, "layers s m kvh d"], layer: Int[Array, ""] | int,
                     kv_len: Int[Array, "s"], *, block_size: int) -> Float[Array, "n h d"]:
    """Attention of compacted query rows over their slots' caches; GQA, float32 softmax.

    Returns ``[n, h, d]`` in ``q.dtype``; padding rows hold unspecified finite values.
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


def slot_runs(rows: Int[Array, "n"], valid: Bool[Array, "n"],
              slots: int, block_size: int) -> tuple[Int[Array, "s"], Int[Array, "s"]]:
    """First compacted row and row count of every slot (rows are slot-major)."""
    slot = jnp.where(valid, rows // block_size, slots)
    count = jnp.zeros((slots,), jnp.int32).at[slot].add(1, mode="drop")
    return jnp.cumsum(count) - count, count


def gpu_layout(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
               k_cache: Float[Array, "layers s m kvh d"], v_cache: Float[Array, "layers s m kvh d"],
               block_size: int, block_m: int) -> tuple[int, Int[Array, "s"], Int[Array, "s"], int]:
    """What the GPU kernels (grid: query tile, KV head, slot) derive from their arguments: the
    GQA group, every slot's first compacted row and row count, and the query-tile height (the
    ``block_size * group`` query vectors of a slot, at most ``block_m`` and at least 16 at a
    time, a power of two). Raises ``ValueError`` for a cache dtype other than the queries'."""
    group = q.shape[1] // k_cache.shape[3]
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        # Casting here would copy the whole cache (every layer) on every call.
        raise ValueError(f"ragged_attention: cache dtype {k_cache.dtype} differs from the "
                         f"queries' {q.dtype}")
    first_row, row_count = slot_runs(rows, valid, k_cache.shape[1], block_size)
    vectors = block_size * group
    return group, first_row, row_count, min(block_m, max(16, 1 << (vectors - 1).bit_length()))
