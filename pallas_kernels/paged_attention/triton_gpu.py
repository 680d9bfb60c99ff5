"""Ragged paged attention as a Triton kernel for NVIDIA GPUs, called through jax-triton.

The contiguous kernel (:mod:`pallas_kernels.ragged_attention.triton_gpu`: grid ``(query tile,
kv head, slot)``, a slot's rows one contiguous run, blocks of ``block_n`` positions, online
softmax) in its paged form: each block's keys and values are gathered through the slot's page
table, position ``p`` being row ``p % B`` of page ``page_table[slot, p // B]``. Table entries
and pages at or past ``kv_len`` are masked out of the loads, so they are never read.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.ragged_attention.reference import (
    BLOCK_M,
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    SlotLayout,
    gpu_layout,
)
from pallas_kernels.ragged_attention.triton_gpu import launch


def paged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                    k_pages: Float[Array, "layers p b kvh d"],
                    v_pages: Float[Array, "layers p b kvh d"], page_table: Int[Array, "s w"],
                    layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *, block_size: int,
                    block_m: int = BLOCK_M, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                    num_stages: int = NUM_STAGES,
                    layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.paged_attention.reference.paged_attention`."""
    _, _, page_size, _, _ = k_pages.shape
    if page_size != block_size:
        raise ValueError(f"paged_attention: pages of {page_size} positions, but block size "
                         f"{block_size}")
    group, layout, block_m = gpu_layout(q, rows, valid, k_pages, v_pages, block_size, block_m,
                                        layout, slots=page_table.shape[0])
    return launch(q, k_pages, v_pages, page_table, layout, kv_len, layer, paged=True,
                  group=group, block_size=block_size, block_m=block_m, block_n=block_n,
                  num_warps=num_warps, num_stages=num_stages)
