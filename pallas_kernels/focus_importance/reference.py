"""FOCUS importance, pure jnp: the ground truth every kernel is held to (SPEC_FOCUS 6.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_NEG_INF = -jnp.inf


def neighbours_in_list(masked: Bool[Array, "s b"]) -> tuple[Int[Array, "s b"], Int[Array, "s b"]]:
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

    previous, following = neighbours_in_list(masked)

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
