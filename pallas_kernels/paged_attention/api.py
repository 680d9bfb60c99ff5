"""Dispatch for ragged paged attention: one entry point, the backend chosen by platform or
``impl``; and the sharded entry point that runs it on every device's KV heads of a mesh."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import sharding
from pallas_kernels.dispatch import choose, implementations
from pallas_kernels.ragged_attention.reference import SlotLayout

IMPLS = implementations("pallas_kernels.paged_attention", "paged_attention")


def paged_attention(*args, impl: str | None = None, **kwargs):
    """Ragged paged attention (contract in :mod:`pallas_kernels.paged_attention.reference`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret`` (the TPU kernel in the Pallas
    interpreter, any platform), ``triton`` (NVIDIA GPUs, through jax-triton); ``None`` picks
    the platform default.
    """
    return choose("paged_attention", IMPLS, impl)(*args, **kwargs)


def paged_attention_sharded(mesh: Mesh | AbstractMesh | None, q: Float[Array, "n h d"],
                            rows: Int[Array, "n"], valid: Bool[Array, "n"],
                            k_pages: Float[Array, "layers p b kvh d"],
                            v_pages: Float[Array, "layers p b kvh d"],
                            page_table: Int[Array, "s w"], layer: Int[Array, ""] | int,
                            kv_len: Int[Array, "s"], *, block_size: int,
                            impl: str | None = None,
                            layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """:func:`paged_attention` inside ``shard_map`` over the ``model`` axis of ``mesh`` where it
    is free (``mesh=None``: the op itself): each device attends with its own KV heads. The pages
    ``[L, P, B, KVH, D]`` split their KV heads over ``model``, the queries ``[n, H, D]`` and the
    result their heads; the page table, ``rows``, ``valid``, ``layer``, ``kv_len`` and
    ``layout`` are replicated. The pool is not split over ``data`` (a ``data`` axis that
    splits is an error)."""
    if sharding.split(mesh, sharding.SLOTS):
        raise ValueError("paged_attention_sharded: the page pool is not split over the data axis")
    sharding.check_divides(k_pages.shape[3], mesh, sharding.HEADS, "KV heads")
    model = sharding.split(mesh, sharding.HEADS)

    def local(q, rows, valid, k_pages, v_pages, page_table, layer, kv_len, layout):
        return paged_attention(q, rows, valid, k_pages, v_pages, page_table, layer, kv_len,
                               block_size=block_size, impl=impl, layout=layout)

    heads = P(None, model, None)
    pages = P(None, None, None, model, None)
    layout_specs = None if layout is None else SlotLayout(P(), P(), P())
    return sharding.manual(local, mesh, (heads, P(), P(), pages, pages, P(), P(), P(),
                                         layout_specs),
                           heads)(q, rows, valid, k_pages, v_pages, page_table,
                                  jnp.asarray(layer, jnp.int32), kv_len, layout)
