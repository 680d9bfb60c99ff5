"""The KV cache: one array for keys and one for values, ``[layers, slots, positions, KVH, D]``.

A slot's position ``p`` holds the key and value of the token at absolute position ``p`` of the
sequence in that slot. Writes name their rows by slot and position; a row whose slot is out of
range (the padding rows of a bucket use ``slots``) is dropped, so padding never writes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from focus_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: Float[Array, "layers slots positions kvh d"]
    v: Float[Array, "layers slots positions kvh d"]

    @classmethod
    def create(cls, cfg: ModelConfig, slots: int, positions: int) -> KVCache:
        shape = (cfg.num_layers, slots, positions, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def positions(self) -> int:
        return self.k.shape[2]

    def write(self, layer: Int[Array, ""] | int, slot: Int[Array, "n"], position: Int[Array, "n"],
              k: Float[Array, "n kvh d"], v: Float[Array, "n kvh d"]) -> KVCache:
        """Write one layer's rows; rows with ``slot >= slots`` are dropped."""
        return KVCache(
            self.k.at[layer, slot, position].set(k.astype(self.k.dtype), mode="drop"),
            self.v.at[layer, slot, position].set(v.astype(self.v.dtype), mode="drop"),
        )

    def write_prefix(self, slot: Int[Array, "n"], length: Int[Array, "n"],
                     k: Float[Array, "layers n t kvh d"],
                     v: Float[Array, "layers n t kvh d"]) -> KVCache:
        """Write positions ``[0, length)`` of every layer for each slot (prefill)."""
        t = k.shape[2]
        position = jnp.arange(t)
        keep = position[None, :] < length[:, None]
        target = jnp.where(keep, slot[:, None], self.slots)  # [n, t]; dropped where not kept
        return KVCache(
            self.k.at[:, target, position[None, :]].set(k.astype(self.k.dtype), mode="drop"),
            self.v.at[:, target, position[None, :]].set(v.astype(self.v.dtype), mode="drop"),
        )
