"""Grouped (ragged) matmul, pure jnp: the ground truth every backend is held to.

Rows of ``lhs`` are sorted by group: rows ``[sum(group_sizes[:i]), sum(group_sizes[:i + 1]))``
multiply ``rhs[i]``. Rows at or past ``sum(group_sizes)`` belong to no group (a bucket's
padding): their output rows are zeros. ``sum(group_sizes) <= m`` is the caller's precondition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from jaxtyping import Array, Bool, Float, Int


def row_groups(group_sizes: Int[Array, "g"], rows: int) -> Int[Array, "m"]:
    """The group of each of ``rows`` rows; ``g`` (one past the last group) for padding rows."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")


def valid_rows(group_sizes: Int[Array, "g"], rows: int) -> Bool[Array, "m"]:
    """Which of ``rows`` rows belong to a group (the rest are padding)."""
    return jnp.arange(rows, dtype=jnp.int32) < jnp.sum(group_sizes.astype(jnp.int32))


def grouped_matmul(lhs: Float[Array, "m k"], rhs: Float[Array, "g k n"] | qwix.QArray,
                   group_sizes: Int[Array, "g"], *,
                   preferred_element_type: jnp.dtype | None = None) -> Float[Array, "m n"]:
    """``out[r] = lhs[r] @ rhs[group of r]``, zeros for padding rows (a quantized ``rhs``:
    its dequantized weight).

    Dense and wasteful on purpose (every row against every group, ``g * m * k`` memory): each
    row's ``lhs`` is placed in its group's slot of a one-hot ``[g, m, k]`` tensor, contracted
    with ``rhs`` over groups and ``k`` in float32. The result has ``preferred_element_type``
    (default: the inputs' promoted dtype).
    """
    if isinstance(rhs, qwix.QArray):
        rhs = qwix.dequantize(rhs)
    g = rhs.shape[0]
    one_hot = row_groups(group_sizes, lhs.shape[0])[None, :] == jnp.arange(g)[:, None]   # [g, m]
    placed = jnp.where(one_hot[:, :, None], lhs[None], 0).astype(jnp.float32)           # [g, m, k]
    out = jnp.einsum("gmk,gkn->mn", placed, rhs.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))
