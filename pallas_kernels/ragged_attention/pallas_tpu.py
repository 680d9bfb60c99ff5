"""Ragged attention as a Pallas TPU (Mosaic) kernel over the compacted rows.

The compacted rows are slot-major (compaction is stable over ``slot * B + position``), so each
slot's rows are one contiguous run: ``first_row[s]`` and ``row_count[s]`` (scalar-prefetched)
locate them. The grid is ``(slot, kv block)``: a program reads the B-row window of queries that
starts at the slot's first row (an element-offset block), and walks the slot's cache in blocks
of ``block_kv`` positions with an online softmax, one KV head group at a time. KV blocks at or
past ``kv_len`` are neither computed nor fetched (their block index repeats the last needed one,
so the pipeline issues no copy); slots without rows do nothing. Output is one padded block per
slot, gathered back to the compacted rows by the wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.sharding import varying_axes

_NEG = -1e30


def _kernel(first_row_ref, row_count_ref, kv_len_ref, layer_ref,
            q_ref, k_ref, v_ref, out_ref, m_ref, l_ref, acc_ref,
            *, heads: int, kv_heads: int, block_kv: int):
    slot, kv_block = pl.program_id(0), pl.program_id(1)
    kv_len = kv_len_ref[slot]
    group = heads // kv_heads
    b, d = q_ref.shape[1], q_ref.shape[2]

    @pl.when(kv_block == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    start = kv_block * block_kv

    @pl.when((row_count_ref[slot] > 0) & (start < kv_len))
    def _accumulate():
        position = start + jax.lax.broadcasted_iota(jnp.int32, (b, block_kv), 1)
        visible = position < kv_len
        for h in range(heads):
            q = q_ref[h].astype(jnp.float32)                       # [B, D]
            k = k_ref[:, h // group, :].astype(jnp.float32)        # [block_kv, D]
            v = v_ref[:, h // group, :].astype(jnp.float32)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * (d ** -0.5)
            s = jnp.where(visible, s, _NEG)
            m_old = m_ref[h]                                       # [B, 1]
            m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            correction = jnp.exp(m_old - m_new)
            l_ref[h] = correction * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[h] = correction * acc_ref[h] + jnp.dot(p, v, preferred_element_type=jnp.float32)
            m_ref[h] = m_new

    @pl.when(kv_block == pl.num_programs(1) - 1)
    def _finish():
        for h in range(heads):
            out_ref[h] = (acc_ref[h] / jnp.maximum(l_ref[h], 1e-30)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "block_kv", "interpret"))
def ragged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                     k_cache: Float[Array, "layers s m kvh d"],
                     v_cache: Float[Array, "layers s m kvh d"], layer: Int[Array, ""] | int,
                     kv_len: Int[Array, "s"], *, block_size: int, block_kv: int = 128,
                     interpret: bool = False) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.ragged_attention.reference.ragged_attention`, with
    the precondition that valid rows come first and are sorted by ``rows`` (what compaction
    gives). ``interpret=True`` runs the kernel in the Pallas TPU interpreter (any platform)."""
    n, h, d = q.shape
    _, slots, positions, kvh, _ = k_cache.shape
    b = block_size
    block_kv = min(block_kv, positions)
    if positions % block_kv:
        raise ValueError(f"cache positions {positions} must be a multiple of block_kv {block_kv}")
    slot_of_row = jnp.where(valid, rows // b, slots)
    row_count = jnp.zeros((slots,), jnp.int32).at[slot_of_row].add(1, mode="drop")
    first_row = jnp.cumsum(row_count) - row_count
    kv_len = kv_len.astype(jnp.int32)
    # Heads leading, and B spare rows so that the last slot's window stays in bounds.
    q_heads = jnp.swapaxes(jnp.pad(q, ((0, b), (0, 0), (0, 0))), 0, 1)

    def kv_index(s, kb, first, count, lengths, layer_):
        return (layer_[0], s, jnp.minimum(kb, jnp.maximum(lengths[s] - 1, 0) // block_kv), 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(slots, positions // block_kv),
        in_specs=[
            pl.BlockSpec((h, pl.Element(b), d), lambda s, kb, first, *_: (0, first[s], 0)),
            pl.BlockSpec((None, None, block_kv, kvh, d), kv_index),
            pl.BlockSpec((None, None, block_kv, kvh, d), kv_index),
        ],
        out_specs=pl.BlockSpec((None, h, b, d), lambda s, kb, *_: (s, 0, 0, 0)),
        scratch_shapes=[pltpu.VMEM((h, b, 1), jnp.float32), pltpu.VMEM((h, b, 1), jnp.float32),
                        pltpu.VMEM((h, b, d), jnp.float32)],
    )
    padded = pl.pallas_call(
        functools.partial(_kernel, heads=h, kv_heads=kvh, block_kv=block_kv),
        out_shape=jax.ShapeDtypeStruct((slots, h, b, d), q.dtype,
                                       manual_axis_type=varying_axes(q, k_cache, v_cache)),
        grid_spec=grid_spec,
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(first_row, row_count, kv_len, jnp.asarray(layer, jnp.int32).reshape(1), q_heads,
      k_cache, v_cache)
    slot = jnp.clip(slot_of_row, 0, slots - 1)
    offset = jnp.clip(jnp.arange(n) - first_row[slot], 0, b - 1)
    return padded[slot, :, offset]
