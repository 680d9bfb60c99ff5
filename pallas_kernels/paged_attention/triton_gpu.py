"""Ragged paged attention as a Triton kernel for NVIDIA GPUs, called through jax-triton.

The contiguous kernel's launch and online softmax
(:mod:`pallas_kernels.ragged_attention.triton_gpu`: grid ``(query tile, kv head, slot)``, a
slot's rows one contiguous run, blocks of ``block_n`` positions), with each block's keys and
values gathered through the slot's page table: position ``p`` is row ``p % B`` of page
``page_table[slot, p // B]``. Table entries and pages at or past ``kv_len`` are masked out of
the loads, so they are never read.
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
            out_ptr, PAGES: tl.constexpr, PAGE: tl.constexpr, WIDTH: tl.constexpr,
            KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr,
            PRECISION: tl.constexpr):
    tile = tl.program_id(0)
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

    kv_len = tl.load(kv_len_ptr + slot) * (tile * BLOCK_M < count * GROUP).to(tl.int32)
    table_row = slot.to(tl.int64) * WIDTH
    m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        position = start + tl.arange(0, BLOCK_N)
        visible = position < kv_len
        page = tl.load(table_ptr + table_row + position // PAGE, mask=visible, other=0)
        kv_row = (layer * PAGES + page.to(tl.int64)) * PAGE + position % PAGE
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


def paged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                    k_pages: Float[Array, "layers p b kvh d"],
                    v_pages: Float[Array, "layers p b kvh d"], page_table: Int[Array, "s w"],
                    layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *, block_size: int,
                    block_m: int = BLOCK_M, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                    num_stages: int = NUM_STAGES,
                    layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.paged_attention.reference.paged_attention`."""
    import jax_triton  # GPU only: imported when the kernel is called

    d = q.shape[-1]
    _, pages, page_size, kv_heads, _ = k_pages.shape
    slots, width = page_table.shape
    if page_size != block_size:
        raise ValueError(f"paged_attention: pages of {page_size} positions, but block size "
                         f"{block_size}")
    group, layout, block_m = gpu_layout(q, rows, valid, k_pages, v_pages, block_size, block_m,
                                        layout, slots=slots)
    return jax_triton.triton_call(
        q, k_pages, v_pages, page_table.astype(jnp.int32), layout.first_row.astype(jnp.int32),
        layout.row_count.astype(jnp.int32),
        jnp.asarray(kv_len, jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
        kernel=_kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(triton.cdiv(block_size * group, block_m), kv_heads, slots), zeroed_outputs=(0,),
        num_warps=num_warps, num_stages=num_stages, PAGES=pages, PAGE=page_size, WIDTH=width,
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        SCALE=d ** -0.5, PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")
