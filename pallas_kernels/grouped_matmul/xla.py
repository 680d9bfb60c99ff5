"""Grouped matmul as XLA's own ragged dot (``jax.lax.ragged_dot``): runs on every platform.

XLA's ragged dot writes zeros to the rows past ``sum(group_sizes)`` (seen on the CPU and on the
H200; ``tests/test_grouped_matmul.py`` holds it to that). On the H200 it is a dense expansion
(each row placed in its group's slot of ``[rows, groups * k]``, then one dot): 2.7-5.8 TFLOP/s
at mixture-of-experts shapes, and out of memory at 65,536 rows of 256 experts
(``docs/kernels.md``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from jaxtyping import Array, Float, Int


def grouped_matmul(lhs: Float[Array, "m k"], rhs: Float[Array, "g k n"] | qwix.QArray,
                   group_sizes: Int[Array, "g"], *,
                   preferred_element_type: jnp.dtype | None = None) -> Float[Array, "m n"]:
    """Contract in :func:`pallas_kernels.grouped_matmul.reference.grouped_matmul`; a quantized
    ``rhs`` goes through qwix's ragged dot (dequantized into XLA's)."""
    ragged_dot = qwix.ragged_dot if isinstance(rhs, qwix.QArray) else jax.lax.ragged_dot
    return ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                      preferred_element_type=preferred_element_type)
