"""The FOCUS eviction policy (SPEC_FOCUS section 6) as pure functions over slots in block layout.

Each of the ``S`` slots holds one active block of ``B`` positions. :func:`importance` measures how
much attention each masked token receives from the other masked tokens at one layer;
:func:`select_retained` turns the change of importance between layers 0 and 1 into the set of
masked tokens worth running through the remaining layers this step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_NEG_INF = -jnp.inf


def _neighbour_in_list(masked: Bool[Array, "s b"]) -> tuple[Int[Array, "s b"], Int[Array, "s b"]]:
    """For every position, the previous and next masked position (``-1`` / ``B`` when none)."""
    b = masked.shape[-1]
    index = jnp.arange(b)
    last_at_or_before = jax.lax.cummax(jnp.where(masked, index, -1), axis=1)
    first_at_or_after = jax.lax.cummin(jnp.where(masked, index, b), axis=1, reverse=True)
    previous = jnp.pad(last_at_or_before[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    following = jnp.pad(first_at_or_after[:, 1:], ((0, 0), (0, 1)), constant_values=b)
    return previous, following


def importance(q: Float[Array, "s b h d"], k: Float[Array, "s b kvh d"],
               masked: Bool[Array, "s b"]) -> Float[Array, "s b"]:
    """Incoming attention of each masked token from the masked tokens of its slot (spec 6.1).

    ``q``/``k`` are one layer's queries and keys after q/k-norm and RoPE. Scores
    ``<q[h, i], k[h // group, j]> / sqrt(D)`` over masked ``i, j`` (float32), max-pooled over
    ``j`` with window 3 where neighbours are neighbours in the masked list, softmax over ``j``,
    summed over heads and queries. Zero where not masked.
    """
    s, b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(s, b, kvh, h // kvh, d)
    scores = jnp.einsum("sikgd,sjkd->skgij", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(d))
    scores = scores.reshape(s, h, b, b)

    previous, following = _neighbour_in_list(masked)

    def key_at(index: Int[Array, "s b"]) -> Float[Array, "s h b b"]:
        inside = (index >= 0) & (index < b)
        gathered = jnp.take_along_axis(
            scores, jnp.clip(index, 0, b - 1)[:, None, None, :], axis=-1)
        return jnp.where(inside[:, None, None, :], gathered, _NEG_INF)

    pooled = jnp.maximum(scores, jnp.maximum(key_at(previous), key_at(following)))
    pooled = jnp.where(masked[:, None, None, :], pooled, _NEG_INF)
    probs = jax.nn.softmax(pooled, axis=-1)
    counted = masked[:, None, :, None] & masked[:, None, None, :]
    return jnp.where(counted, probs, 0.0).sum(axis=(1, 2))


def retention_budget(masked_count: Int[Array, "s"], avg_decoded: Float[Array, "s"],
                     alpha: float) -> Int[Array, "s"]:
    """``K = min(L, max(1, ceil(alpha * max(avg, 1))))``, computed in float32 (spec 6.3)."""
    wanted = jnp.ceil(jnp.float32(alpha) * jnp.maximum(avg_decoded.astype(jnp.float32), 1.0))
    return jnp.minimum(masked_count, jnp.maximum(1, wanted.astype(jnp.int32)))


def select_retained(delta: Float[Array, "s b"], masked: Bool[Array, "s b"],
                    progress: Int[Array, "s"], avg_decoded: Float[Array, "s"],
                    alpha: float) -> Bool[Array, "s b"]:
    """The masked slots that stay in this step (spec 6.3-6.7); False where not masked.

    ``delta`` is ``I_1 - I_0``; ``masked`` marks the masked slots processed this step;
    ``progress`` the rightmost slot with KV in every layer (-1 at block start); ``avg_decoded``
    the tokens unmasked per decoding step so far in this block.
    """
    b = delta.shape[-1]
    index = jnp.arange(b)
    delta = delta.astype(jnp.float32)
    count = masked.sum(axis=-1)
    budget = retention_budget(count, avg_decoded, alpha)

    n = jnp.maximum(count, 1).astype(jnp.float32)[:, None]
    mean = jnp.where(masked, delta, 0.0).sum(axis=-1, keepdims=True) / n
    var = jnp.where(masked, jnp.square(delta - mean), 0.0).sum(axis=-1, keepdims=True) / n
    candidates = masked & (delta >= mean + jnp.sqrt(var))

    # Rank among masked slots by delta, descending; ties go to the earlier slot.
    beats = (delta[:, None, :] > delta[:, :, None]) | (
        (delta[:, None, :] == delta[:, :, None]) & (index[None, :] < index[:, None])[None])
    rank = (beats & masked[:, None, :]).sum(axis=-1)
    top_k = masked & (rank < budget[:, None])
    use_candidates = candidates.sum(axis=-1) >= budget
    retained = jnp.where(use_candidates[:, None], candidates, top_k)

    # One pass of adjacency: an evicted slot whose right neighbour is masked and retained joins.
    right_retained = jnp.pad(retained[:, 1:], ((0, 0), (0, 1)))
    retained = retained | (masked & right_retained)

    retained = jnp.where(retained.any(axis=-1, keepdims=True), retained, masked)
    retained = jnp.where((count <= budget)[:, None], masked, retained)

    # Masked slots between progress and the rightmost retained one have no KV in layers >= 2 yet,
    # and retained queries attend up to that slot: they must run too.
    rightmost = jnp.max(jnp.where(retained, index, -1), axis=-1)
    unprocessed = (index[None, :] > progress[:, None]) & (index[None, :] < rightmost[:, None])
    return retained | (masked & unprocessed)
