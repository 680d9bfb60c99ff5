"""Ragged attention as a Pallas TPU (Mosaic) kernel, tiled for the MXU.

Query tiles: the wrapper scatters the compacted rows back to their slots and lays each slot's
queries out per KV head as one tile of ``B * group`` rows (the slot's ``B`` positions times the
query heads of that KV head: the GQA group folded into the matmul rows), padded to a multiple
of the sublane tiling (8 rows for 32-bit, 16 for 16-bit types). Every tile starts at row 0 of
its block, so every block is aligned; a slot holds at most ``B`` rows, and ``B`` is 4 to 64,
so a tile is as small as any row packing could make it.

Grid ``(slot, kv block)``: a program holds its slot's query tiles of every KV head
(``[KVH, T, D]``) and streams that slot's cache of the current layer in blocks of
``block_kv`` positions ``[block_kv, KVH, D]`` (the layer and ``kv_len`` are scalar-prefetched
into the index maps). Per KV head, two MXU matmuls per block (``[T, D] x [D, block_kv]`` and
``[T, block_kv] x [block_kv, D]``) in the input dtype with float32 accumulation, and an online
softmax whose running max and sum are kept lane-wide (``[T, 128]``, every lane equal) so that
they load and store as whole vregs. KV blocks at or past ``kv_len`` are neither computed nor
fetched (their block index repeats the last needed one, so the pipeline issues no copy); slots
without rows count as ``kv_len = 0`` and fetch one block. The output tiles are gathered back
to the compacted rows by the wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.ragged_attention.reference import SlotLayout
from pallas_kernels.sharding import varying_axes

_NEG = -1e30
LANES = 128
VMEM_BUDGET = 12 * 2 ** 20
"""Bytes of VMEM a program may plan for (v5e's default scoped limit is 16 MiB)."""
VMEM_LIMIT_MAX = 64 * 2 ** 20
"""A cap on the scoped VMEM a program asks Mosaic for (twice its plan, at least the 16 MiB
default); a plan within :data:`VMEM_BUDGET` asks for at most 24 MiB."""


def compiler_params(vmem: int) -> pltpu.CompilerParams:
    """Slots in parallel, KV blocks in order; scoped VMEM for a plan of ``vmem`` bytes (twice
    it, at least the 16 MiB default, at most :data:`VMEM_LIMIT_MAX`)."""
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                vmem_limit_bytes=min(max(16 * 2 ** 20, 2 * vmem), VMEM_LIMIT_MAX))


MAX_BLOCK_KV = 512


def sublane_tile(dtype) -> int:
    """Rows of one vreg tile for ``dtype``: 8 for 32-bit types, 16 for 16-bit ones."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def vmem_bytes(tile_rows: int, kv_heads: int, head_dim: int, block_kv: int, dtype) -> int:
    """VMEM of one program: double-buffered query, output and K/V blocks (padded to whole
    tiles) and the float32 scratch."""
    item = jnp.dtype(dtype).itemsize
    lanes = _round_up(head_dim, LANES)
    tiles = 2 * 2 * kv_heads * tile_rows * lanes * item
    kv = 2 * 2 * block_kv * _round_up(kv_heads, sublane_tile(dtype)) * lanes * item
    scratch = kv_heads * tile_rows * (2 * LANES + lanes) * 4
    return tiles + kv + scratch


def choose_block_kv(positions: int, tile_rows: int, kv_heads: int, head_dim: int, dtype) -> int:
    """The largest divisor of ``positions`` up to 512 whose program fits :data:`VMEM_BUDGET`
    (the smallest divisor when none does)."""
    divisors = [b for b in range(min(positions, MAX_BLOCK_KV), 0, -1) if positions % b == 0]
    fitting = [b for b in divisors
               if vmem_bytes(tile_rows, kv_heads, head_dim, b, dtype) <= VMEM_BUDGET]
    return (fitting or divisors[-1:])[0]


def matmul_precision(dtype) -> jax.lax.Precision | None:
    """16-bit inputs: one MXU pass (Mosaic refuses a float32 contract precision for them, which
    ``jax_default_matmul_precision="highest"`` would ask for); float32: as configured."""
    return None if jnp.dtype(dtype).itemsize == 4 else jax.lax.Precision.DEFAULT


def attend_kv_block(kv_len_ref, layer_ref, q_ref, k_ref, v_ref, out_ref, m_ref, l_ref, acc_ref,
                    *, block_kv: int, scale: float, precision: jax.lax.Precision | None):
    """The body of a program of grid ``(slot, kv block)``: the online softmax of the slot's
    query tiles ``q_ref [KVH, T, D]`` over the KV block ``k_ref``, ``v_ref [block_kv, KVH, D]``
    (positions ``kv_block * block_kv`` on; those at or past ``kv_len`` masked, a block wholly
    past it skipped), the output written after the last block. Also the paged kernel's
    (:mod:`pallas_kernels.paged_attention.pallas_tpu`), which fills the KV block from pages."""
    del layer_ref  # used by the index maps only
    slot, kv_block = pl.program_id(0), pl.program_id(1)
    kv_len = kv_len_ref[slot]
    kv_heads, rows = q_ref.shape[0], q_ref.shape[1]

    @pl.when(kv_block == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    start = kv_block * block_kv

    @pl.when(start < kv_len)
    def _accumulate():
        visible = start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1) < kv_len
        for head in range(kv_heads):
            q = q_ref[head]                                          # [T, D]
            k = k_ref[:, head, :].astype(q.dtype)                    # [block_kv, D]
            v = v_ref[:, head, :].astype(q.dtype)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * scale
            s = jnp.where(visible, s, _NEG)                          # [T, block_kv]
            m_old = m_ref[head]                                      # [T, 128]
            m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
            # Position `start` is visible, so every row's max is a real score and the masked
            # entries' exponentials vanish.
            p = jnp.exp(s - m_new[:, :1])
            correction = jnp.exp(m_old - m_new)
            l_ref[head] = correction * l_ref[head] + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[head] = correction[:, :1] * acc_ref[head] + jnp.dot(
                p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
            m_ref[head] = m_new

    @pl.when(kv_block == pl.num_programs(1) - 1)
    def _finish():
        for head in range(kv_heads):
            total = jnp.maximum(l_ref[head][:, :1], 1e-30)          # 0 for slots without rows
            out_ref[head] = (acc_ref[head] / total).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "block_kv", "interpret"))
def ragged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                     k_cache: Float[Array, "layers s m kvh d"],
                     v_cache: Float[Array, "layers s m kvh d"], layer: Int[Array, ""] | int,
                     kv_len: Int[Array, "s"], *, block_size: int, block_kv: int | None = None,
                     interpret: bool = False,
                     layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.ragged_attention.reference.ragged_attention`
    (``layout`` is for the GPU kernels' launch: ignored here).

    ``block_kv``: cache positions per KV block (a divisor of the cache's ``M``; ``None``: the
    largest up to 512 that fits the VMEM budget). ``interpret=True`` runs the kernel in the
    Pallas interpreter (any platform).
    """
    _, h, d = q.shape
    _, slots, positions, kv_heads, _ = k_cache.shape
    b, group = block_size, h // kv_heads
    tile_rows = _round_up(b * group, sublane_tile(q.dtype))
    if block_kv is None:
        block_kv = choose_block_kv(positions, tile_rows, kv_heads, d, k_cache.dtype)
    if positions % block_kv:
        raise ValueError(f"cache positions {positions} must be a multiple of block_kv {block_kv}")

    if interpret:
        # The interpreter threads its inputs through a while loop. Inside a shard_map with
        # check_vma off (the sharded entry point's) nested in one with it on (the decode
        # step's), a cache passed straight in keeps the outer varying-axes type while the loop
        # body's result has none; the result of an operation here is typed afresh (a copy
        # primitive keeps the type).
        k_cache, v_cache = k_cache * 1, v_cache * 1
    flat, tiles, kv_len = query_tiles(q, rows, valid, kv_len, slots, b, kv_heads, tile_rows)

    def kv_index(s, kb, lengths, layer_):
        last = jnp.maximum(lengths[s] - 1, 0) // block_kv
        return layer_[0], s, jnp.minimum(kb, last), 0, 0

    tile_spec = pl.BlockSpec((None, kv_heads, tile_rows, d), lambda s, kb, *_: (s, 0, 0, 0))
    kv_spec = pl.BlockSpec((None, None, block_kv, kv_heads, d), kv_index)
    vmem = vmem_bytes(tile_rows, kv_heads, d, block_kv, k_cache.dtype)
    out = pl.pallas_call(
        functools.partial(attend_kv_block, block_kv=block_kv, scale=d ** -0.5,
                          precision=matmul_precision(q.dtype)),
        out_shape=jax.ShapeDtypeStruct(
            tiles.shape, q.dtype,
            manual_axis_type=varying_axes(q, rows, valid, k_cache, v_cache, kv_len)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(slots, positions // block_kv),
            in_specs=[tile_spec, kv_spec, kv_spec], out_specs=tile_spec,
            scratch_shapes=[pltpu.VMEM((kv_heads, tile_rows, LANES), jnp.float32),
                            pltpu.VMEM((kv_heads, tile_rows, LANES), jnp.float32),
                            pltpu.VMEM((kv_heads, tile_rows, d), jnp.float32)]),
        interpret=interpret,
        compiler_params=compiler_params(vmem),
    )(kv_len, jnp.asarray(layer, jnp.int32).reshape(1), tiles, k_cache, v_cache)
    return rows_from_tiles(out, flat, b, group)


def query_tiles(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                kv_len: Int[Array, "s"], slots: int, block_size: int, kv_heads: int,
                tile_rows: int) -> tuple[Int[Array, "n"], Float[Array, "s kvh t d"],
                                         Int[Array, "s"]]:
    """The compacted rows' flat indices (padding: ``S * B``), their query tiles (per slot and
    KV head, the ``B`` positions times the group's query heads, padded to ``tile_rows``), and
    ``kv_len`` with slots that have no rows at 0 (they fetch and compute nothing)."""
    _, h, d = q.shape
    b, group = block_size, h // kv_heads
    flat = jnp.where(valid, rows, slots * b)
    has_rows = jnp.zeros((slots,), bool).at[flat // b].set(True, mode="drop")
    kv_len = jnp.where(has_rows, kv_len, 0).astype(jnp.int32)
    tiles = jnp.zeros((slots * b, h, d), q.dtype).at[flat].set(q, mode="drop")
    tiles = tiles.reshape(slots, b, kv_heads, group, d).transpose(0, 2, 1, 3, 4)
    tiles = jnp.pad(tiles.reshape(slots, kv_heads, b * group, d),
                    ((0, 0), (0, 0), (0, tile_rows - b * group), (0, 0)))
    return flat, tiles, kv_len


def rows_from_tiles(out: Float[Array, "s kvh t d"], flat: Int[Array, "n"], block_size: int,
                    group: int) -> Float[Array, "n h d"]:
    """The output tiles back at the compacted rows (:func:`query_tiles`' ``flat``)."""
    slots, kv_heads, _, d = out.shape
    b = block_size
    out = out[:, :, :b * group].reshape(slots, kv_heads, b, group, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(slots * b, kv_heads * group, d)[jnp.clip(flat, 0, slots * b - 1)]
