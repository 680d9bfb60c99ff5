"""The KV cache behind one interface: everything the decoder writes to or reads from its cached
keys and values goes through :class:`KVCache`, whatever the layout behind it.

A cache holds, for each of ``S`` slots, the keys and values of positions ``[0, M)`` of every
layer: position ``p`` of a slot holds the key and value of the token at absolute position ``p``
of the sequence in that slot. Writes name their rows by slot and position; a row whose slot is
out of range (the padding rows of a bucket use ``S``) is dropped, so padding never writes.
"""

from __future__ import annotations

from typing import Protocol, Self

from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from focus_jax.cache.contiguous import ContiguousCache
from focus_jax.cache.paged import PagedCache, assign_pages
from pallas_kernels.ragged_attention.reference import SlotLayout

__all__ = ["ContiguousCache", "KVCache", "PagedCache", "assign_pages"]


class KVCache(Protocol):
    """What the decoder asks of a KV cache (a pytree: it lives in the decode state)."""

    @property
    def slots(self) -> int:
        """``S``."""
        ...

    @property
    def positions(self) -> int:
        """``M``, positions per slot."""
        ...

    def write(self, layer: Int[Array, ""] | int, slot: Int[Array, "n"],
              position: Int[Array, "n"], k: Float[Array, "n kvh d"],
              v: Float[Array, "n kvh d"]) -> Self:
        """Write one layer's rows; rows with ``slot >= S`` are dropped."""
        ...

    def write_prefix(self, slot: Int[Array, "n"], start: Int[Array, "n"], length: Int[Array, "n"],
                     k: Float[Array, "layers n t kvh d"],
                     v: Float[Array, "layers n t kvh d"]) -> Self:
        """Write positions ``[start, length)`` of every layer for each slot (prefill): entry
        ``i`` of ``k`` and ``v`` is position ``start + i``."""
        ...

    def read_prefix(self, slot: Int[Array, "n"],
                    width: int) -> tuple[Float[Array, "layers n w kvh d"],
                                         Float[Array, "layers n w kvh d"]]:
        """Keys and values of positions ``[0, width)`` of every layer for each slot (a slot out
        of range reads zeros)."""
        ...

    def attend(self, q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
               layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *, block_size: int,
               impl: str | None, mesh: Mesh | None,
               layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
        """Attention of compacted query rows (row ``n``: flat index ``slot * B + i``) over their
        slots' keys and values at positions ``[0, kv_len[slot])`` of ``layer``: the contract of
        :mod:`pallas_kernels.ragged_attention.reference`, with kernels ``impl`` on ``mesh``."""
        ...

    def specs(self, kv_heads: str | None) -> Self:
        """The cache's ``PartitionSpec`` per field: slots over ``data``, KV heads over
        ``kv_heads``."""
        ...

    def to_shard(self, axis: str, sign: int = 1) -> Self:
        """Inside ``shard_map`` over ``axis`` (``data``): this shard's part of the cache as the
        shard addresses it (``sign=1``), or back as the whole cache addresses it (``sign=-1``)."""
        ...
