"""FOCUS importance as a Pallas TPU (Mosaic) kernel: one grid step per slot.

Per KV head, its GQA group's query heads stacked into one tile of ``G * B`` rows: scores
``q k^T / sqrt(D)`` of the block (a ``[G*B, B]`` matmul on the MXU), max-pool over the key
index with the neighbours *in the masked list* taken by two one-hot matmuls (``s @ P_prev``,
``s @ P_next``, exact at HIGHEST precision), masked softmax over keys, and the column sums
accumulated over queries and heads. Every block spans whole array dimensions, so Mosaic's
tiling rule holds for any ``B``, group and head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float

from pallas_kernels.focus_importance.reference import neighbours_in_list
from pallas_kernels.sharding import varying_axes

_HIGHEST = jax.lax.Precision.HIGHEST


def _kernel(q_ref, k_ref, previous_ref, following_ref, key_mask_ref, query_mask_ref, out_ref):
    kv_heads, b = k_ref.shape[0], k_ref.shape[1]
    d = q_ref.shape[-1]
    key_masked = key_mask_ref[...] > 0          # [1, B]
    query_weight = query_mask_ref[...]          # [G*B, 1], 1.0 for masked queries
    previous = previous_ref[...]                # [1, B]
    following = following_ref[...]             # [1, B]
    source = jax.lax.broadcasted_iota(jnp.int32, (b, b), 0)
    pick_previous = (source == previous).astype(jnp.float32)   # [j', j] = (j' == prev[j])
    pick_following = (source == following).astype(jnp.float32)
    neg_inf = jnp.float32(-jnp.inf)
    total = jnp.zeros((1, b), jnp.float32)
    for kv_head in range(kv_heads):
        q = q_ref[kv_head].astype(jnp.float32)  # [G*B, D]: the group's query heads stacked
        k = k_ref[kv_head].astype(jnp.float32)  # [B, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
        s_previous = jnp.dot(s, pick_previous, precision=_HIGHEST)
        s_following = jnp.dot(s, pick_following, precision=_HIGHEST)
        pooled = jnp.maximum(s, jnp.maximum(jnp.where(previous >= 0, s_previous, neg_inf),
                                            jnp.where(following < b, s_following, neg_inf)))
        pooled = jnp.where(key_masked, pooled, neg_inf)
        row_max = jnp.max(pooled, axis=1, keepdims=True)
        row_max = jnp.where(row_max > neg_inf, row_max, 0.0)    # rows with no masked key
        e = jnp.where(key_masked, jnp.exp(pooled - row_max), 0.0)
        probs = e / jnp.maximum(jnp.sum(e, axis=1, keepdims=True), 1e-30)
        total = total + jnp.sum(probs * query_weight, axis=0, keepdims=True)
    out_ref[...] = jnp.where(key_masked, total, 0.0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def importance(q: Float[Array, "s b h d"], k: Float[Array, "s b kvh d"],
               masked: Bool[Array, "s b"], *, interpret: bool = False) -> Float[Array, "s b"]:
    """Same contract as :func:`pallas_kernels.focus_importance.reference.importance`.

    ``interpret=True`` runs the kernel in the Pallas interpreter (any platform).
    """
    s, b, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    previous, following = neighbours_in_list(masked)
    weights = masked.astype(jnp.float32)
    # [S, H, B, D] -> [S, KVH, G*B, D] (free: heads are KV-head major): one tile per KV head.
    q_tiles = jnp.swapaxes(q, 1, 2).reshape(s, kvh, group * b, d)
    slot = lambda *block: pl.BlockSpec((None, *block), lambda i: (i,) + (0,) * len(block))
    out = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((s, 1, b), jnp.float32,
                                       manual_axis_type=varying_axes(q, k, masked)),
        grid=(s,),
        in_specs=[slot(kvh, group * b, d), slot(kvh, b, d), slot(1, b), slot(1, b), slot(1, b),
                  slot(group * b, 1)],
        out_specs=slot(1, b),
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    )(q_tiles, jnp.swapaxes(k, 1, 2), previous[:, None].astype(jnp.int32),
      following[:, None].astype(jnp.int32), weights[:, None],
      jnp.tile(weights, (1, group))[..., None])
    return out[:, 0]
