"""Dispatch for ragged attention: one entry point, the backend chosen by platform or ``impl``;
and the sharded entry point that runs it on every device's slots and KV heads of a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import sharding
from pallas_kernels.dispatch import choose, implementations
from pallas_kernels.ragged_attention.reference import SlotLayout

IMPLS = implementations("pallas_kernels.ragged_attention", "ragged_attention")


def ragged_attention(*args, impl: str | None = None, **kwargs):
    """Ragged attention (contract in :mod:`pallas_kernels.ragged_attention.reference`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret`` (the TPU kernel in the Pallas
    interpreter, any platform), ``triton`` (NVIDIA GPUs, through jax-triton), ``pallas_triton``
    (NVIDIA GPUs, Pallas's Triton backend; ``pallas_triton_interpret`` in its interpreter);
    ``None`` picks the platform default.
    """
    return choose("ragged_attention", IMPLS, impl)(*args, **kwargs)


def ragged_attention_sharded(mesh: Mesh | AbstractMesh | None, q: Float[Array, "n h d"],
                             rows: Int[Array, "n"], valid: Bool[Array, "n"],
                             k_cache: Float[Array, "layers s m kvh d"],
                             v_cache: Float[Array, "layers s m kvh d"],
                             layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *,
                             block_size: int, impl: str | None = None,
                             layout: SlotLayout | None = None,
                             **options) -> Float[Array, "n h d"]:
    """:func:`ragged_attention` inside ``shard_map`` over every axis of ``mesh`` not already
    manual where it is called: each device attends with its own KV heads of its own slots
    (``mesh=None``: the op itself).

    Arguments and result as in :func:`ragged_attention` (``impl`` and ``options`` go to it).
    The cache ``[L, S, M, KVH, D]`` splits its slots ``S`` over ``data`` and its KV heads
    ``KVH`` over ``model``; ``kv_len [S]`` splits over ``data``; the queries ``[n, H, D]`` and
    the result split their heads ``H`` over ``model`` (query heads go with their KV heads).
    ``rows``, ``valid`` and ``layer`` are replicated.

    Called inside a ``shard_map`` that already made ``data`` manual (each data shard holds its
    own slots and compacted rows; ``rows`` index its local ``S_local * B`` tokens), only
    ``model`` is made manual here. Called where ``data`` is still free and splits the slots,
    every data shard sees all rows, attends those of its slots, and the result is summed over
    ``data`` (each row has one non-zero term): callers that compact per shard should call it
    inside their own ``shard_map`` over ``data`` instead. ``layout`` (the rows'
    :func:`~pallas_kernels.ragged_attention.reference.slot_layout`) is passed on where the rows
    stay as they are, and left to the kernel to derive where a data shard reorders them.
    """
    _, slots, _, kv_heads, _ = k_cache.shape
    sharding.check_divides(kv_heads, mesh, sharding.HEADS, "KV heads")
    sharding.check_divides(slots, mesh, sharding.SLOTS, "slots")
    data, model = sharding.split(mesh, sharding.SLOTS), sharding.split(mesh, sharding.HEADS)

    def local(q, rows, valid, k_cache, v_cache, layer, kv_len, layout):
        if data is None:
            return ragged_attention(q, rows, valid, k_cache, v_cache, layer, kv_len,
                                    block_size=block_size, impl=impl, layout=layout, **options)
        first_slot = jax.lax.axis_index(data) * k_cache.shape[1]
        slot = rows // block_size - first_slot
        mine = valid & (slot >= 0) & (slot < k_cache.shape[1])
        # This shard's rows first, in their order (the kernels' precondition).
        order = jnp.argsort(~mine, stable=True)
        local_rows = jnp.where(mine, rows - first_slot * block_size, 0)[order]
        out = ragged_attention(q[order], local_rows, mine[order], k_cache, v_cache, layer,
                               kv_len, block_size=block_size, impl=impl, **options)
        out = out[jnp.argsort(order)]
        return jax.lax.psum(jnp.where(mine[:, None, None], out, 0), data)

    heads = P(None, model, None)
    cache = P(None, data, None, model, None)
    if data is not None:
        layout = None
    layout_specs = None if layout is None else SlotLayout(P(), P(), P())
    return sharding.manual(local, mesh, (heads, P(), P(), cache, cache, P(), P(data), layout_specs),
                           heads)(q, rows, valid, k_cache, v_cache, jnp.asarray(layer, jnp.int32),
                                  kv_len, layout)
