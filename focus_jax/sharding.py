"""Sharding over a ``("data", "expert", "model")`` mesh: slots over ``data``, a mixture's
experts over ``expert``, heads and the width of MLPs and experts over ``model``.

Parameters carry logical axis names (see ``models/layers.py``); :data:`RULES` maps them to mesh
axes. The decode state and KV cache are sharded by slot over ``data`` (and the cache's KV heads
over ``model``). JAX's SPMD partitioner does the rest: the code under ``jit`` is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from focus_jax.config import ConfigError, ModelConfig

AXES = ("data", "expert", "model")
RULES: Mapping[str, str | None] = {
    "vocab": "model", "embed": None, "heads": "model", "kv_heads": "model", "head_dim": None,
    "mlp": "model", "layers": None, "norm": None, "qkv": None, "gate_up": None,
    "expert": "expert", "expert_mlp": "model", "router": None,
}


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "expert": 1, "model": 4}`` (missing axes are 1)."""
    sizes = {"data": 1, "expert": 1, "model": 1}
    named = set()
    for part in (p.strip() for p in spec.split(",")):
        name, _, value = part.partition("=")
        # An empty part (a stray comma) or a repeated axis is a typo, not a 1x1 mesh.
        if name not in sizes or name in named or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"bad mesh {spec!r}: expected e.g. data=2,model=4 (axes: data, "
                              f"expert, model)")
        named.add(name)
        sizes[name] = int(value)
    return sizes


def make_mesh(data: int = 1, model: int = 1, devices: list | None = None,
              expert: int = 1) -> Mesh:
    """A ``("data", "expert", "model")`` mesh over the first ``data * expert * model`` devices."""
    devices = jax.devices() if devices is None else devices
    count = data * expert * model
    if count > len(devices):
        raise ConfigError(f"mesh data={data},expert={expert},model={model} needs {count} "
                          f"devices, {len(devices)} available")
    return Mesh(np.array(devices[:count]).reshape(data, expert, model), AXES)


def check_divisible(cfg: ModelConfig, mesh: Mesh | Mapping[str, int],
                    slots: int | None = None) -> None:
    """Clear errors when a sharded dimension does not divide by its mesh axis (``mesh``: a mesh or
    its axis sizes)."""
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    model, data, expert = sizes["model"], sizes["data"], sizes.get("expert", 1)
    split_by_model = [("num_attention_heads", cfg.num_heads),
                      ("num_key_value_heads", cfg.num_kv_heads),
                      ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)]
    if cfg.moe is not None:
        split_by_model += [("moe_intermediate_size", cfg.moe.expert_size),
                           ("the shared experts' width", cfg.moe.shared_expert_size)]
        if cfg.moe.num_experts % expert:
            raise ConfigError(f"num_experts = {cfg.moe.num_experts} does not divide by the "
                              f"mesh's expert axis ({expert})")
    elif expert > 1:
        raise ConfigError(f"the mesh's expert axis ({expert}) needs a mixture-of-experts model; "
                          f"{cfg.model_type} has none")
    for name, size in split_by_model:
        if size % model:
            raise ConfigError(f"{name} = {size} does not divide by the mesh's model axis ({model})")
    if slots is not None and slots % data:
        raise ConfigError(f"{slots} slots do not divide by the mesh's data axis ({data}): use a "
                          f"batch size that is a multiple of {data}")


def spec_for(axes: tuple[str | None, ...], mesh_axes: tuple[str, ...] = AXES) -> PartitionSpec:
    """The PartitionSpec of logical ``axes`` by :data:`RULES` (mesh axes a mesh lacks:
    replicated)."""
    return PartitionSpec(*(RULES.get(a) if a and RULES.get(a) in mesh_axes else None
                           for a in axes))


def manual_param_specs(params: nnx.State, axes: set[str]) -> nnx.State:
    """A PartitionSpec per parameter naming only the mesh ``axes`` (those a ``shard_map`` makes
    manual): what each device passes in of it; the other axes stay with the partitioner."""
    def spec(var: nnx.Variable) -> PartitionSpec:
        full = spec_for(var.get_metadata().get("out_sharding") or ())
        return PartitionSpec(*(a if a in axes else None for a in full))

    return jax.tree.map(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_sharding(var: nnx.Variable, mesh: Mesh) -> NamedSharding:
    """A parameter's NamedSharding on ``mesh``, from its logical axis names."""
    return NamedSharding(mesh, spec_for(var.get_metadata().get("out_sharding") or (),
                                        mesh.axis_names))


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """A NamedSharding per parameter, from its logical axis names."""
    return jax.tree.map(lambda var: param_sharding(var, mesh), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(tree, shardings):
    """``jax.device_put`` that also works when the mesh spans several processes (there, arrays
    go through host memory: a process can only write its own devices)."""
    if jax.process_count() > 1:
        tree = jax.device_get(tree)
    return jax.device_put(tree, shardings)


def shard_params(params: nnx.State, mesh: Mesh) -> nnx.State:
    """Place the parameters on the mesh."""
    return place(params, param_shardings(params, mesh))


def state_specs(state, kv_heads: str | None = "model"):
    """PartitionSpecs of a decode state: every array's leading slot axis over ``data``, the KV
    cache as its layout says (:meth:`focus_jax.cache.KVCache.specs`: slots over ``data``, KV
    heads over ``kv_heads``)."""
    specs = jax.tree.map(lambda _: PartitionSpec("data"), state)
    return dataclasses.replace(specs, cache=state.cache.specs(kv_heads))


def state_sharding(state, mesh: Mesh):
    """NamedShardings of a decode state on ``mesh`` (see :func:`state_specs`)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(state),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def bytes_per_device(tree, shardings) -> int:
    """Bytes each device holds of ``tree`` (arrays or ``ShapeDtypeStruct``s) placed with
    ``shardings`` (a matching tree of ``NamedSharding``s; ``None``: all on one device): a
    replicated array counts whole on every device, a split one by its shard."""
    arrays = jax.tree.leaves(tree)
    if shardings is None:
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)
    places = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    return sum(math.prod(where.shard_shape(a.shape)) * a.dtype.itemsize
               for a, where in zip(arrays, places, strict=True))


def bytes_on(tree, device: jax.Device) -> int:
    """Bytes of ``tree``'s arrays that ``device`` holds now (NumPy arrays and shapes: none)."""
    def held(x) -> int:
        where = getattr(x, "sharding", None)
        if not isinstance(x, jax.Array) or device not in where.device_set:
            return 0
        return math.prod(where.shard_shape(x.shape)) * x.dtype.itemsize

    return sum(held(x) for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Resident:
    """Bytes per device of what stays in device memory between programs."""

    weights: int
    decode_state: int
    """Nearly all of it the KV cache."""

    @property
    def total(self) -> int:
        return self.weights + self.decode_state


def resident_bytes(params: nnx.State, state, mesh: Mesh | None) -> Resident:
    """Per-device bytes of the weights ``params`` and the decode state ``state`` (arrays or
    shapes, e.g. from ``jax.eval_shape``) as the engine places them on ``mesh`` (``None``: one
    device)."""
    if mesh is None:
        return Resident(bytes_per_device(params, None), bytes_per_device(state, None))
    return Resident(bytes_per_device(params, param_shardings(params, mesh)),
                    bytes_per_device(state, state_sharding(state, mesh)))
