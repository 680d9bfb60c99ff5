"""The contiguous layout: one array for keys and one for values, ``[layers, slots, positions,
KVH, D]``; every slot reserves all ``M`` positions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from focus_jax.config import ModelConfig
from focus_jax.policies import kernel
from pallas_kernels.ragged_attention import ragged_attention, ragged_attention_sharded
from pallas_kernels.ragged_attention.reference import SlotLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousCache:
    k: Float[Array, "layers slots positions kvh d"]
    v: Float[Array, "layers slots positions kvh d"]

    @classmethod
    def create(cls, cfg: ModelConfig, slots: int, positions: int) -> ContiguousCache:
        shape = (cfg.num_layers, slots, positions, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def positions(self) -> int:
        return self.k.shape[2]

    def write(self, layer: Int[Array, ""] | int, slot: Int[Array, "n"], position: Int[Array, "n"],
              k: Float[Array, "n kvh d"], v: Float[Array, "n kvh d"]) -> ContiguousCache:
        """Write one layer's rows; rows with ``slot >= slots`` are dropped."""
        return ContiguousCache(
            self.k.at[layer, slot, position].set(k.astype(self.k.dtype), mode="drop"),
            self.v.at[layer, slot, position].set(v.astype(self.v.dtype), mode="drop"),
        )

    def write_prefix(self, slot: Int[Array, "n"], start: Int[Array, "n"], length: Int[Array, "n"],
                     k: Float[Array, "layers n t kvh d"],
                     v: Float[Array, "layers n t kvh d"]) -> ContiguousCache:
        """Write positions ``[start, length)`` of every layer for each slot (prefill)."""
        position = start[:, None] + jnp.arange(k.shape[2])
        target = jnp.where(position < length[:, None], slot[:, None], self.slots)  # else dropped
        return ContiguousCache(
            self.k.at[:, target, position].set(k.astype(self.k.dtype), mode="drop"),
            self.v.at[:, target, position].set(v.astype(self.v.dtype), mode="drop"),
        )

    def read_prefix(self, slot: Int[Array, "n"], width: int) -> tuple[Array, Array]:
        """Positions ``[0, width)`` of every layer for each slot ``[L, n, width, KVH, D]``."""
        return tuple(a[:, :, :width].at[:, slot].get(mode="fill", fill_value=0)
                     for a in (self.k, self.v))

    def attend(self, q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
               layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *, block_size: int,
               impl: str | None, mesh: Mesh | None,
               layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
        """Ragged attention over the slots' rows of the cache (:class:`KVCache.attend`)."""
        attention = kernel(ragged_attention, ragged_attention_sharded, impl, mesh)
        return attention(q, rows, valid, self.k, self.v, layer, kv_len, block_size=block_size,
                         layout=layout)

    def specs(self, kv_heads: str | None) -> ContiguousCache:
        """Slots over ``data``, KV heads over ``kv_heads``."""
        spec = PartitionSpec(None, "data", None, kv_heads, None)
        return ContiguousCache(spec, spec)

    def to_shard(self, axis: str, sign: int = 1) -> ContiguousCache:
        """A shard's slots are addressed locally by the step already: nothing to change."""
        return self
