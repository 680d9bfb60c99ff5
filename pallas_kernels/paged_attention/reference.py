"""Ragged paged attention, pure jnp: the ground truth every paged kernel is held to.

The queries are the compacted rows of a decode step, as for
:mod:`pallas_kernels.ragged_attention.reference`: row ``n`` is the token at flat index
``rows[n] = slot * block_size + position_in_block``; rows with ``valid[n] = False`` are padding.
The keys and values live in pages of ``block_size`` positions, ``[layers, pages, block_size, KVH,
D]``; a slot's position ``p`` is position ``p % block_size`` of page ``page_table[slot, p //
block_size]``. Each query attends, non-causally, to its slot's positions ``[0, kv_len[slot])``
of layer ``layer``. Pages may be shared between slots (a cached prompt prefix) and listed in any
order; table entries past a slot's length are never read (they may be anything, out of range
included).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.ragged_attention import reference as contiguous
from pallas_kernels.ragged_attention.reference import SlotLayout


def slot_pages(pages: Float[Array, "layers p b kvh d"], page_table: Int[Array, "s w"],
               layer: Int[Array, ""] | int, kv_len: Int[Array, "s"]) -> Float[Array, "s w*b kvh d"]:
    """Each slot's keys (or values) of ``layer`` in position order, gathered through its page
    table: ``[S, W * B, KVH, D]``. Pages at or past ``kv_len`` are not read (zeros)."""
    _, count, b, kvh, d = pages.shape
    s, width = page_table.shape
    needed = jnp.arange(width)[None, :] * b < kv_len[:, None]
    index = jnp.where(needed, page_table, count)  # out of range: filled, never read
    gathered = pages[layer].at[index].get(mode="fill", fill_value=0)
    return gathered.reshape(s, width * b, kvh, d)


def paged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                    k_pages: Float[Array, "layers p b kvh d"],
                    v_pages: Float[Array, "layers p b kvh d"], page_table: Int[Array, "s w"],
                    layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *,
                    block_size: int, layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Attention of compacted query rows over their slots' pages; GQA, float32 softmax.

    Returns ``[n, h, d]`` in ``q.dtype``; padding rows hold unspecified finite values. The
    same numbers as :func:`pallas_kernels.ragged_attention.reference.ragged_attention` over a
    contiguous cache holding the same keys and values. ``layout``: the rows'
    :class:`~pallas_kernels.ragged_attention.reference.SlotLayout` for the GPU kernel's launch
    (ignored here).
    """
    if k_pages.shape[2] != block_size:
        raise ValueError(f"paged_attention: pages of {k_pages.shape[2]} positions, but block "
                         f"size {block_size}")
    k = slot_pages(k_pages, page_table, layer, kv_len)
    v = slot_pages(v_pages, page_table, layer, kv_len)
    return contiguous.ragged_attention(q, rows, valid, k[None], v[None], 0, kv_len,
                                       block_size=block_size)
