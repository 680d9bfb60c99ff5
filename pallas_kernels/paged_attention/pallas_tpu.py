"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

The query tiles and the online softmax are the contiguous kernel's
(:mod:`pallas_kernels.ragged_attention.pallas_tpu`): grid ``(slot, kv block)``, a program
holds its slot's query tiles of every KV head and accumulates over KV blocks of ``block_kv``
positions. Here a KV block is ``pages_per_block`` pages, which the program copies itself from
the pool in HBM into a VMEM buffer (one DMA per page, the page ids read from the page table
prefetched into SMEM, flattened). Blocks at or past the slot's ``kv_len`` copy and compute
nothing, and within the last block a page past ``kv_len`` is replaced by the last page needed
(its positions are masked): no page past a slot's length is read, whatever its table lists
there. Slots without rows count as ``kv_len = 0``.

The copies of a block are waited for before it is computed (no prefetch of the next block
across grid steps yet: tpu-inference's ragged paged attention double-buffers them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.ragged_attention.pallas_tpu import (
    LANES,
    MAX_BLOCK_KV,
    VMEM_BUDGET,
    attend_kv_block,
    compiler_params,
    matmul_precision,
    query_tiles,
    rows_from_tiles,
    sublane_tile,
    vmem_bytes,
)
from pallas_kernels.ragged_attention.reference import SlotLayout
from pallas_kernels.sharding import varying_axes


def choose_pages_per_block(width: int, page_size: int, tile_rows: int, kv_heads: int,
                           head_dim: int, dtype) -> int:
    """The most pages (a divisor of the table's ``width``) whose KV block holds at most 512
    positions and whose program fits :data:`VMEM_BUDGET` (1 when none does)."""
    fitting = [p for p in range(1, width + 1)
               if width % p == 0 and p * page_size <= MAX_BLOCK_KV
               and vmem_bytes(tile_rows, kv_heads, head_dim, p * page_size, dtype) <= VMEM_BUDGET]
    return max(fitting, default=1)


def _kernel(kv_len_ref, layer_ref, table_ref, q_ref, k_pool, v_pool, out_ref, k_ref, v_ref,
            copies_ref, m_ref, l_ref, acc_ref, *, pages_per_block: int, page_size: int,
            width: int, pages: int, scale: float, precision: jax.lax.Precision | None):
    slot, kv_block = pl.program_id(0), pl.program_id(1)
    kv_len = kv_len_ref[slot]
    block_kv = pages_per_block * page_size

    @pl.when(kv_block * block_kv < kv_len)
    def _fetch():
        last = (kv_len - 1) // page_size
        copies = []
        for j in range(pages_per_block):
            entry = jnp.minimum(kv_block * pages_per_block + j, last)
            page = jnp.clip(table_ref[slot * width + entry], 0, pages - 1)
            for pool, buffer, kind in ((k_pool, k_ref, 0), (v_pool, v_ref, 1)):
                copy = pltpu.make_async_copy(pool.at[layer_ref[0], page],
                                             buffer.at[pl.ds(j * page_size, page_size)],
                                             copies_ref.at[kind, j])
                copy.start()
                copies.append(copy)
        for copy in copies:
            copy.wait()

    attend_kv_block(kv_len_ref, layer_ref, q_ref, k_ref, v_ref, out_ref, m_ref, l_ref, acc_ref,
                    block_kv=block_kv, scale=scale, precision=precision)


@functools.partial(jax.jit, static_argnames=("block_size", "pages_per_block", "interpret"))
def paged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                    k_pages: Float[Array, "layers p b kvh d"],
                    v_pages: Float[Array, "layers p b kvh d"], page_table: Int[Array, "s w"],
                    layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *, block_size: int,
                    pages_per_block: int | None = None, interpret: bool = False,
                    layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.paged_attention.reference.paged_attention`
    (``layout`` is for the GPU kernel's launch: ignored here).

    ``pages_per_block``: pages per KV block (``None``: :func:`choose_pages_per_block`).
    ``interpret=True`` runs the kernel in the Pallas interpreter (any platform).
    """
    _, h, d = q.shape
    _, pages, page_size, kv_heads, _ = k_pages.shape
    slots, width = page_table.shape
    if page_size != block_size:
        raise ValueError(f"paged_attention: pages of {page_size} positions, but block size "
                         f"{block_size}")
    b, group = block_size, h // kv_heads
    tile = sublane_tile(q.dtype)
    tile_rows = -(-b * group // tile) * tile
    if pages_per_block is None:
        pages_per_block = choose_pages_per_block(width, page_size, tile_rows, kv_heads, d,
                                                 k_pages.dtype)
    block_kv = pages_per_block * page_size
    flat, tiles, kv_len = query_tiles(q, rows, valid, kv_len, slots, b, kv_heads, tile_rows)
    if interpret:  # see the contiguous kernel: the inputs typed afresh for the interpreter
        k_pages, v_pages = k_pages * 1, v_pages * 1

    tile_spec = pl.BlockSpec((None, kv_heads, tile_rows, d), lambda s, kb, *_: (s, 0, 0, 0))
    pool_spec = pl.BlockSpec(memory_space=pl.ANY)
    vmem = vmem_bytes(tile_rows, kv_heads, d, block_kv, k_pages.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, pages_per_block=pages_per_block, page_size=page_size,
                          width=width, pages=pages, scale=d ** -0.5,
                          precision=matmul_precision(q.dtype)),
        out_shape=jax.ShapeDtypeStruct(
            tiles.shape, q.dtype,
            manual_axis_type=varying_axes(q, rows, valid, k_pages, v_pages, page_table, kv_len)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(slots, -(-width // pages_per_block)),
            in_specs=[tile_spec, pool_spec, pool_spec], out_specs=tile_spec,
            scratch_shapes=[pltpu.VMEM((block_kv, kv_heads, d), k_pages.dtype),
                            pltpu.VMEM((block_kv, kv_heads, d), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2, pages_per_block)),
                            pltpu.VMEM((kv_heads, tile_rows, LANES), jnp.float32),
                            pltpu.VMEM((kv_heads, tile_rows, LANES), jnp.float32),
                            pltpu.VMEM((kv_heads, tile_rows, d), jnp.float32)]),
        interpret=interpret,
        compiler_params=compiler_params(vmem),
    )(kv_len, jnp.asarray(layer, jnp.int32).reshape(1),
      page_table.reshape(-1).astype(jnp.int32), tiles, k_pages, v_pages)
    return rows_from_tiles(out, flat, b, group)
