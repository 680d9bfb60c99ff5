"""Running a kernel inside ``shard_map`` over every mesh axis that is not manual yet.

A Mosaic (Pallas TPU) call can only sit where every mesh axis is manual, size-1 axes included
(the partitioner cannot split a custom call); the same holds for any kernel that should run on
its shard of the data rather than on arrays the partitioner gathered for it. The ops' sharded
entry points (``ragged_attention_sharded``, ``focus_importance_sharded``) use this module to
find the axes still left to the partitioner and to make them manual. Slots split over
:data:`SLOTS`, heads over :data:`HEADS`; any other mesh axis is replicated.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

SLOTS = "data"
"""The mesh axis that splits slots (the KV cache's slot axis, a decode state's leading axis)."""
HEADS = "model"
"""The mesh axis that splits attention heads (query heads with their KV heads), and the width of
MLPs and experts."""
EXPERTS = "expert"
"""The mesh axis that splits a mixture of experts' experts."""


def free_axes(mesh: Mesh | AbstractMesh) -> frozenset[str]:
    """The axes of ``mesh`` not yet manual where this is traced (inside ``shard_map`` over
    ``data``, only ``model`` is left)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return frozenset(mesh.axis_names) - manual


def split(mesh: Mesh | AbstractMesh | None, axis: str) -> str | None:
    """``axis`` where it is free in ``mesh`` and splits an array, else ``None`` (the name to
    put into a ``PartitionSpec``)."""
    if mesh is None or axis not in free_axes(mesh):
        return None
    return axis if mesh.shape[axis] > 1 else None


def held(mesh: Mesh | AbstractMesh | None, axis: str) -> str | None:
    """``axis`` where it is already manual where this is traced and larger than one (each
    device holds its share of what the axis splits), else ``None``."""
    if mesh is None or axis not in mesh.axis_names or axis in free_axes(mesh):
        return None
    return axis if mesh.shape[axis] > 1 else None


def check_divides(size: int, mesh: Mesh | AbstractMesh | None, axis: str, what: str) -> None:
    """A clear error when ``axis`` splits ``size`` unevenly."""
    if split(mesh, axis) and size % mesh.shape[axis]:
        raise ValueError(f"{what} = {size} does not divide by the mesh's {axis} axis "
                         f"({mesh.shape[axis]})")


def manual(f, mesh: Mesh | AbstractMesh | None, in_specs: tuple, out_specs: PartitionSpec):
    """``f`` inside ``shard_map`` over every free axis of ``mesh`` (the enclosing manual context
    where there is one), or ``f`` itself without a mesh or when no axis is free.

    ``check_vma`` is off: Triton calls and the Pallas interpreter have no varying-axes rules;
    the callers' out_specs leave out only axes they have reduced over (or that are size 1)."""
    axes = free_axes(mesh) if mesh is not None else frozenset()
    if not axes:
        return f
    context = jax.sharding.get_abstract_mesh()
    return jax.shard_map(f, mesh=mesh if context.empty else context, in_specs=in_specs,
                         out_specs=out_specs, axis_names=set(axes), check_vma=False)


def varying_axes(*arrays: jax.Array) -> jax.sharding.ManualAxisType:
    """The manual mesh axes any of ``arrays`` varies over: what a kernel's ``out_shape`` must
    declare inside ``shard_map`` with ``check_vma=True``."""
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))
    return jax.sharding.ManualAxisType(varying=varying)
