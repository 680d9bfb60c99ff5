"""Every product of activations with a layer's weights, in one place.

The projections of attention and MLPs, the LM head and the experts' grouped matmuls all call
:func:`project` or :func:`grouped`, so that what a weight is (its dtype, its layout) is decided
here and nowhere in the layers.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.grouped_matmul import grouped_matmul


def project(spec: str, x: Float[Array, "..."], w: Float[Array, "..."], *,
            preferred_element_type: jnp.dtype | None = None) -> Float[Array, "..."]:
    """``einsum(spec, x, w)``: activations ``x`` times the weight ``w`` (``spec`` names the
    activations first, e.g. ``"...e,ef->...f"``)."""
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)


def grouped(x: Float[Array, "m k"], w: Float[Array, "g k n"], group_sizes: Int[Array, "g"], *,
            preferred_element_type: jnp.dtype | None = None) -> Float[Array, "m n"]:
    """Rows of ``x`` sorted by group times their group's weight ``w[g]`` (the experts'
    matmul, :func:`pallas_kernels.grouped_matmul.grouped_matmul`)."""
    return grouped_matmul(x, w, group_sizes, preferred_element_type=preferred_element_type)
