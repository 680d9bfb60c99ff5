"""FOCUS importance as a Triton kernel for NVIDIA GPUs, called through jax-triton.

One program per (slot, query head): float32 scores ``q k^T / sqrt(D)`` of the block (tensor-core
dots in the input dtype with float32 accumulation; exact IEEE float32 for float32 inputs), and
the same queries against the keys of each position's previous and next neighbour *in the
masked list* (those keys are gathered by pointer, so the max-pool is three small dots and two
maxima); masked softmax over keys; column sums over masked queries. The per-head sums are added
up outside (a deterministic order, unlike atomics). Blocks smaller than 16 are padded to 16
(the smallest tensor-core tile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from jaxtyping import Array, Bool, Float

from pallas_kernels.focus_importance.reference import neighbours_in_list


@triton.jit
def _scores(q, k_ptr, key_position, kv_head, inside, KV_HEADS: tl.constexpr,
            HEAD_DIM: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr):
    """Float32 scores of ``q`` against the keys at ``key_position`` (flat slot * B + index)."""
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + ((key_position * KV_HEADS + kv_head) * HEAD_DIM)[:, None] + d[None, :],
                mask=inside[:, None], other=0.0)
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE


@triton.jit
def _kernel(q_ptr, k_ptr, masked_ptr, previous_ptr, following_ptr, out_ptr,
            BLOCK: tl.constexpr, PADDED: tl.constexpr, HEADS: tl.constexpr,
            KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
            PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (HEADS // KV_HEADS)
    i = tl.arange(0, PADDED)
    inside = i < BLOCK
    position = slot * BLOCK + i
    masked = tl.load(masked_ptr + position, mask=inside, other=0) != 0
    previous = tl.load(previous_ptr + position, mask=inside, other=-1)
    following = tl.load(following_ptr + position, mask=inside, other=BLOCK)
    has_previous = previous >= 0
    has_following = following < BLOCK
    previous = slot * BLOCK + tl.where(has_previous, previous, 0)
    following = slot * BLOCK + tl.where(has_following, following, 0)

    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + ((position * HEADS + head) * HEAD_DIM)[:, None] + d[None, :],
                mask=inside[:, None], other=0.0)
    pooled = _scores(q, k_ptr, position, kv_head, inside, KV_HEADS, HEAD_DIM, SCALE, PRECISION)
    pooled = tl.where(has_previous[None, :], tl.maximum(pooled, _scores(
        q, k_ptr, previous, kv_head, inside, KV_HEADS, HEAD_DIM, SCALE, PRECISION)), pooled)
    pooled = tl.where(has_following[None, :], tl.maximum(pooled, _scores(
        q, k_ptr, following, kv_head, inside, KV_HEADS, HEAD_DIM, SCALE, PRECISION)), pooled)
    pooled = tl.where(masked[None, :], pooled, -1e30)
    p = tl.exp(pooled - tl.max(pooled, axis=1)[:, None])
    p = tl.where(masked[:, None] & masked[None, :], p, 0.0)
    column = tl.sum(p / tl.maximum(tl.sum(p, axis=1), 1e-30)[:, None], axis=0)
    tl.store(out_ptr + (slot * HEADS + head) * BLOCK + i, column, mask=inside)


def importance(q: Float[Array, "s b h d"], k: Float[Array, "s b kvh d"],
               masked: Bool[Array, "s b"], *, num_warps: int = 4) -> Float[Array, "s b"]:
    """Same contract as :func:`pallas_kernels.focus_importance.reference.importance`."""
    import jax_triton  # GPU only: imported when the kernel is called

    s, b, h, d = q.shape
    kv_heads = k.shape[2]
    previous, following = neighbours_in_list(masked)
    per_head = jax_triton.triton_call(
        q, k.astype(q.dtype), masked.astype(jnp.int32), previous.astype(jnp.int32),
        following.astype(jnp.int32), kernel=_kernel,
        out_shape=jax.ShapeDtypeStruct((s, h, b), jnp.float32), grid=(s, h),
        num_warps=num_warps, BLOCK=b, PADDED=max(16, triton.next_power_of_2(b)), HEADS=h,
        KV_HEADS=kv_heads, HEAD_DIM=d, SCALE=d ** -0.5,
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")
    return per_head.sum(axis=1)
