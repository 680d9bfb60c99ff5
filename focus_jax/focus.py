"""The FOCUS eviction policy (SPEC_FOCUS section 6) as pure functions over slots in block layout.

Each of the ``S`` slots holds one active block of ``B`` positions. :func:`importance` measures how
much attention each masked token receives from the other masked tokens at one layer (its pure-jnp
definition lives with its kernels in ``pallas_kernels.focus_importance``);
:func:`select_retained` turns the change of importance between layers 0 and 1 into the set of
masked tokens worth running through the remaining layers this step.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.focus_importance.reference import importance

__all__ = ["importance", "retention_budget", "select_retained"]


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
