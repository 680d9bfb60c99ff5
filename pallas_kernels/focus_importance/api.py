"""Dispatch for FOCUS importance: one entry point, the backend chosen by platform or ``impl``;
and the sharded entry point that runs it on every device's slots and heads of a mesh."""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from pallas_kernels import sharding
from pallas_kernels.dispatch import choose, implementations

IMPLS = implementations("pallas_kernels.focus_importance", "importance")


def focus_importance(q, k, masked, *, impl: str | None = None):
    """FOCUS importance (contract in :func:`pallas_kernels.focus_importance.reference.importance`).

    ``impl``: ``xla``, ``pallas_tpu``, ``pallas_tpu_interpret``, ``triton`` (NVIDIA GPUs,
    through jax-triton); ``None`` picks the platform default.
    """
    return choose("focus_importance", IMPLS, impl)(q, k, masked)


def focus_importance_sharded(mesh: Mesh | AbstractMesh | None, q: Float[Array, "s b h d"],
                             k: Float[Array, "s b kvh d"], masked: Bool[Array, "s b"], *,
                             impl: str | None = None) -> Float[Array, "s b"]:
    """:func:`focus_importance` inside ``shard_map`` over every axis of ``mesh`` not already
    manual where it is called (``mesh=None``: the op itself).

    Slots ``s`` (of ``q``, ``k``, ``masked`` and the result ``[s, b]``) split over ``data``;
    the query heads ``h`` and KV heads ``kvh`` split over ``model`` (each device holds whole
    GQA groups), and the per-device importance, a sum over its heads, is summed over ``model``
    (``psum``). Inside a ``shard_map`` that already made ``data`` manual, only ``model`` is
    made manual here.
    """
    sharding.check_divides(k.shape[2], mesh, sharding.HEADS, "KV heads")
    sharding.check_divides(q.shape[0], mesh, sharding.SLOTS, "slots")
    data, model = sharding.split(mesh, sharding.SLOTS), sharding.split(mesh, sharding.HEADS)

    def local(q, k, masked):
        out = focus_importance(q, k, masked, impl=impl)
        return out if model is None else jax.lax.psum(out, model)

    heads = P(data, None, model, None)
    return sharding.manual(local, mesh, (heads, heads, P(data)), P(data))(q, k, masked)
