"""Ragged attention as a Triton kernel for NVIDIA GPUs, called through jax-triton.

The compacted rows are slot-major (compaction is stable over ``slot * B + position``), so a
slot's rows are one contiguous run ``[first_row[s], first_row[s] + row_count[s])``. The grid is
``(query tile, kv head, slot)``: a program stacks the rows of its slot times the query heads of
its KV head (``B * group`` query vectors, in tiles of at most ``block_m``) and walks that slot's
cache of the current layer in blocks of ``block_n`` positions with an online softmax (float32
statistics and accumulator, tensor-core dots in the input dtype). Programs whose tile holds no
row stop at once; no program reads cache at or past ``kv_len``. Output rows are written in place
at their compacted index; padding rows are zero.

Triton suits this op: a gather of a slot's rows and a data-dependent loop bound, both plain
pointer arithmetic here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.ragged_attention.reference import (
    BLOCK_M,
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    SlotLayout,
    gpu_layout,
)


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, table_ptr, first_row_ptr, row_count_ptr, kv_len_ptr, layer_ptr,
            out_ptr, PAGED: tl.constexpr, PAGES: tl.constexpr, PAGE: tl.constexpr,
            WIDTH: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            SCALE: tl.constexpr, PRECISION: tl.constexpr):
    """Both layouts: a cache ``[layers, PAGES, PAGE, kv heads, d]`` read through the slot's row
    of the page table ``[slots, WIDTH]`` (``PAGED``), or, contiguous, one page per slot
    (``PAGES`` = slots, ``PAGE`` = positions; ``table_ptr`` unread)."""
    tile = tl.program_id(0)  # fastest: a slot's tiles run side by side and share its cache in L2
    kv_head = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(row_count_ptr + slot)
    first = tl.load(first_row_ptr + slot)
    layer = tl.load(layer_ptr).to(tl.int64)

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)        # query vector = row * GROUP + head
    row = i // GROUP
    head = kv_head * GROUP + i % GROUP
    row_ok = row < count
    d = tl.arange(0, HEAD_DIM)
    q_offset = ((first + row) * (KV_HEADS * GROUP) + head).to(tl.int64) * HEAD_DIM
    q = tl.load(q_ptr + q_offset[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)

    # A tile without rows walks no cache.
    kv_len = tl.load(kv_len_ptr + slot) * (tile * BLOCK_M < count * GROUP).to(tl.int32)
    table_row = slot.to(tl.int64) * WIDTH
    m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        position = start + tl.arange(0, BLOCK_N)
        visible = position < kv_len  # table entries and pages past kv_len are never read
        if PAGED:
            page = tl.load(table_ptr + table_row + position // PAGE, mask=visible,
                           other=0).to(tl.int64)
        else:
            page = slot.to(tl.int64)
        kv_row = (layer * PAGES + page) * PAGE + position % PAGE
        pointers = ((kv_row * KV_HEADS + kv_head) * HEAD_DIM)[:, None] + d[None, :]
        k = tl.load(k_ptr + pointers, mask=visible[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE
        s = tl.where(visible[None, :], s, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        correction = tl.exp(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, axis=1)
        v = tl.load(v_ptr + pointers, mask=visible[:, None], other=0.0)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_offset[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def launch(q, k, v, page_table, layout: SlotLayout, kv_len, layer, *, paged: bool, group: int,
           block_size: int, block_m: int, block_n: int, num_warps: int,
           num_stages: int) -> jax.Array:
    """The kernel over ``(query tile, kv head, slot)`` for either layout (:func:`_kernel`)."""
    import jax_triton  # GPU only: imported when the kernel is called

    d = q.shape[-1]
    _, pages, page, kv_heads, _ = k.shape
    slots, width = page_table.shape
    return jax_triton.triton_call(
        q, k, v, page_table.astype(jnp.int32), layout.first_row.astype(jnp.int32),
        layout.row_count.astype(jnp.int32),
        jnp.asarray(kv_len, jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
        kernel=_kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(triton.cdiv(block_size * group, block_m), kv_heads, slots), zeroed_outputs=(0,),
        num_warps=num_warps, num_stages=num_stages, PAGED=paged, PAGES=pages, PAGE=page,
        WIDTH=width, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=d, BLOCK_M=block_m,
        BLOCK_N=block_n, SCALE=d ** -0.5, PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")


def ragged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                     k_cache: Float[Array, "layers s m kvh d"],
                     v_cache: Float[Array, "layers s m kvh d"], layer: Int[Array, ""] | int,
                     kv_len: Int[Array, "s"], *, block_size: int,
                     block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                     num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                     layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.ragged_attention.reference.ragged_attention`."""
    slots = k_cache.shape[1]
    group, layout, block_m = gpu_layout(q, rows, valid, k_cache, v_cache, block_size, block_m,
                                        layout)
    # A slot's cache is its one page; the table is a placeholder the kernel does not read.
    return launch(q, k_cache, v_cache, jnp.zeros((slots, 1), jnp.int32), layout, kv_len, layer,
                  paged=False, group=group, block_size=block_size, block_m=block_m,
                  block_n=block_n, num_warps=num_warps, num_stages=num_stages)
