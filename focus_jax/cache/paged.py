"""The paged layout: a pool of pages of one block (``B`` positions) each, ``[layers, pages, B,
KVH, D]`` for keys and for values, and a page table per slot, ``[slots, M / B]``: a slot's
position ``p`` lives at position ``p % B`` of page ``page_table[slot, p // B]``.

The host decides which pages a slot uses (:mod:`focus_jax.cache.pages`) and writes the slot's
table row before it runs (:func:`assign_pages`); a table entry ``>= pages`` names no page, and a
write to it is dropped. Two slots may list the same page (a shared prompt prefix): only the
first to compute it writes it, the others read it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from focus_jax.config import ModelConfig
from focus_jax.policies import kernel
from pallas_kernels.paged_attention import paged_attention, paged_attention_sharded
from pallas_kernels.ragged_attention.reference import SlotLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    k: Float[Array, "layers pages b kvh d"]
    v: Float[Array, "layers pages b kvh d"]
    page_table: Int[Array, "slots w"]
    """Each slot's pages in position order; ``pages`` (or more) where it has none."""

    @classmethod
    def create(cls, cfg: ModelConfig, slots: int, positions: int, block_size: int,
               pages: int) -> PagedCache:
        """``pages`` pages of ``block_size`` positions; ``slots`` slots of up to ``positions``
        positions each (a multiple of the block size), none assigned."""
        shape = (cfg.num_layers, pages, block_size, cfg.num_kv_heads, cfg.head_dim)
        table = jnp.full((slots, positions // block_size), pages, jnp.int32)
        return cls(jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype), table)

    @staticmethod
    def page_bytes(cfg: ModelConfig, block_size: int, kv_head_shards: int = 1) -> int:
        """Bytes of one page (keys and values of every layer) on each device, the KV heads
        split ``kv_head_shards`` ways."""
        return (2 * cfg.num_layers * block_size * cfg.num_kv_heads // kv_head_shards
                * cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize)

    @property
    def slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def positions(self) -> int:
        return self.page_table.shape[1] * self.block_size

    @property
    def pages(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def _page(self, slot: Int[Array, "..."], position: Int[Array, "..."]) -> Int[Array, "..."]:
        """The page holding each (slot, position); ``pages`` (dropped by writes) for a slot out
        of range."""
        return self.page_table.at[slot, position // self.block_size].get(
            mode="fill", fill_value=self.pages)

    def write(self, layer: Int[Array, ""] | int, slot: Int[Array, "n"], position: Int[Array, "n"],
              k: Float[Array, "n kvh d"], v: Float[Array, "n kvh d"]) -> PagedCache:
        """Write one layer's rows; rows with ``slot >= slots`` are dropped."""
        page, offset = self._page(slot, position), position % self.block_size
        return dataclasses.replace(
            self,
            k=self.k.at[layer, page, offset].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[layer, page, offset].set(v.astype(self.v.dtype), mode="drop"))

    def write_prefix(self, slot: Int[Array, "n"], start: Int[Array, "n"], length: Int[Array, "n"],
                     k: Float[Array, "layers n t kvh d"],
                     v: Float[Array, "layers n t kvh d"]) -> PagedCache:
        """Write positions ``[start, length)`` of every layer for each slot (prefill): the pages
        of positions before ``start`` (a shared prefix) are not touched."""
        position = start[:, None] + jnp.arange(k.shape[2])
        page = jnp.where(position < length[:, None], self._page(slot[:, None], position),
                         self.pages)  # [n, t]; dropped where not kept
        offset = position % self.block_size
        return dataclasses.replace(
            self,
            k=self.k.at[:, page, offset].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, page, offset].set(v.astype(self.v.dtype), mode="drop"))

    def read_prefix(self, slot: Int[Array, "n"], width: int) -> tuple[Array, Array]:
        """Positions ``[0, width)`` (whole blocks) of every layer for each slot, read through
        its pages: ``[L, n, width, KVH, D]``."""
        page = self._page(slot[:, None], jnp.arange(0, width, self.block_size)[None, :])
        layers, _, _, kvh, d = self.k.shape
        return tuple(a.at[:, page].get(mode="fill", fill_value=0).reshape(
            layers, slot.shape[0], width, kvh, d) for a in (self.k, self.v))

    def attend(self, q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
               layer: Int[Array, ""] | int, kv_len: Int[Array, "s"], *, block_size: int,
               impl: str | None, mesh: Mesh | None,
               layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
        """Ragged paged attention over the slots' pages (:class:`KVCache.attend`)."""
        attention = kernel(paged_attention, paged_attention_sharded, impl, mesh)
        return attention(q, rows, valid, self.k, self.v, self.page_table, layer, kv_len,
                         block_size=block_size, layout=layout)

    def specs(self, kv_heads: str | None) -> PagedCache:
        """Pages over ``data`` (each data shard holds the pages of its own slots: the host gives
        a slot only pages of its shard, :class:`~focus_jax.cache.pages.ShardedPool`), KV heads
        over ``kv_heads``; the page table's slots over ``data``."""
        pages = PartitionSpec(None, "data", None, kv_heads, None)
        return PagedCache(pages, pages, PartitionSpec("data", None))

    def to_shard(self, axis: str, sign: int = 1) -> PagedCache:
        """Inside ``shard_map`` over ``axis`` the pool holds only this shard's pages: its table
        entries (whole-pool page ids) minus the shard's first page (``sign=-1``: plus, back).
        An entry naming no page (``>=`` the whole pool) still names none."""
        first = jax.lax.axis_index(axis) * self.pages
        return dataclasses.replace(self, page_table=self.page_table - sign * first)


def assign_pages(cache: PagedCache, slot: Int[Array, "n"], table: Int[Array, "n w"]) -> PagedCache:
    """Set the page-table rows of ``slot`` to ``table`` (rows with ``slot >= slots`` are
    padding)."""
    return dataclasses.replace(cache, page_table=cache.page_table.at[slot].set(table, mode="drop"))
