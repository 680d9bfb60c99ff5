"""Ragged attention as a Pallas kernel for NVIDIA GPUs, through Pallas's Triton backend.

The algorithm and launch shape of :mod:`.triton_gpu`: a grid of ``(query tile, KV head, slot)``;
a program stacks its slot's compacted rows times the query heads of its KV head and walks that
slot's cache of the layer in blocks of ``block_n`` positions with an online softmax (float32
statistics and accumulator). What differs is how it reaches XLA. jax-triton hands XLA an opaque
custom call, which ends every CUDA command buffer XLA records around it (a lightly loaded decode
step launches about 1,200 kernels and loses about 3 ms to the gaps between them,
docs/serving.md). This kernel becomes XLA's own Triton custom call (``__gpu$xla.gpu.triton``),
which XLA compiles with the program, so the kernels around it can stay in one command buffer.

**The grid covers the occupied slots only, their walks split.** Its slot axis is
``min(rows, slots)`` long (:func:`occupied_slots`: the most slots the bucket's rows can occupy)
and lists the slots that have rows; with few rows (a lightly loaded engine: 8 requests in 256
slots) that is far fewer programs than one per slot, of which nearly all would find no rows.
In buckets of at most :data:`SPLIT_MAX_ROWS` rows each occupied slot's cache walk is then
shared by up to :data:`MAX_KV_SPLITS` programs (:func:`default_kv_splits`: no more programs
than one per slot in all; larger buckets measured faster unsplit), which write
unnormalised partial results (accumulator, running maximum and sum) that a small XLA merge
combines. A split over every slot's programs was measured and removed (docs/kernels.md): it
multiplied the empty programs.

Not the GPU default yet: its GPU tests pass on the H200 and it serves (``--kernels
pallas_triton``), faster than the jax-triton kernel at light load and no slower at batch 256
(docs/serving.md); the engine's GPU tests have not run with it as the default. JAX 0.11 marks
Pallas's Triton backend deprecated (Mosaic GPU is its successor), so the kernel to keep is a
Mosaic GPU one (H100/H200 and later), or jax-triton's call made command-buffer compatible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.ragged_attention.reference import (
    BLOCK_M,
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    SlotLayout,
    gpu_layout,
    occupied_slots,
)

__all__ = ["MAX_KV_SPLITS", "SPLIT_MAX_ROWS", "default_kv_splits", "occupied_slots",
           "ragged_attention"]

NEG_INF = -1e30

MAX_KV_SPLITS = 4
"""The most programs that share one slot's cache walk (:func:`default_kv_splits`)."""
SPLIT_MAX_ROWS = 32
"""Buckets of at most this many rows split each occupied slot's cache walk; larger ones walk
it in one program. Measured on the H200 with 8 or 16 live slots of 256 (docs/kernels.md,
"A grid over the occupied slots only"): split, buckets of 16 and 32 rows took 16.1 and 21.4 us
against 18.5 and 24.9 unsplit; buckets of 64 and 128 took 32-39 us against 26-33."""


def default_kv_splits(rows: int, slots: int) -> int:
    """Programs per occupied slot (:func:`occupied_slots`) sharing its cache walk: for buckets
    of at most :data:`SPLIT_MAX_ROWS` rows, as many as keep the grid no larger than one program
    per slot, at most :data:`MAX_KV_SPLITS`; 1 for larger buckets."""
    if rows > SPLIT_MAX_ROWS:
        return 1
    return max(1, min(MAX_KV_SPLITS, slots // occupied_slots(rows, slots)))


def ragged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                     k_cache: Float[Array, "layers s m kvh d"],
                     v_cache: Float[Array, "layers s m kvh d"], layer: Int[Array, ""] | int,
                     kv_len: Int[Array, "s"], *, block_size: int,
                     block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                     num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                     kv_splits: int | None = None, interpret: bool = False,
                     layout: SlotLayout | None = None) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.ragged_attention.reference.ragged_attention`
    (padding rows come back zero). ``kv_splits``: programs sharing each occupied slot's cache
    walk (default :func:`default_kv_splits`). ``interpret``: run in the Pallas interpreter (any
    platform). ``layout``: the rows' slot layout, if the caller computed it (its grid's slot
    axis: ``layout.occupied``)."""
    n, h, d = q.shape
    _, slots, positions, kv_heads, _ = k_cache.shape
    splits = default_kv_splits(n, slots) if kv_splits is None else kv_splits
    if splits < 1:
        raise ValueError(f"ragged_attention: kv_splits must be >= 1, got {splits}")
    group, layout, block_m = gpu_layout(q, rows, valid, k_cache, v_cache, block_size, block_m,
                                        layout)
    occupied = layout.occupied  # the grid's slot axis: the slots with rows, then `slots`
    # Lanes without a row load and store at ``spare``. A masked store writes nothing on the GPU,
    # so row 0 serves there; the interpreter stores masked lanes back (read, select, write), so
    # a lane without a row must not share a row with one that has it: a spare row past the end.
    vectors_out = n * h + (1 if interpret else 0)
    kernel = functools.partial(
        _kernel, spare=vectors_out - 1 if interpret else 0, vectors_out=vectors_out,
        slots=slots, positions=positions, kv_heads=kv_heads, group=group, splits=splits,
        block_m=block_m, block_n=block_n, scale=d ** -0.5,
        precision=(jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                   else jax.lax.Precision.DEFAULT))
    if splits == 1:  # the output itself (it starts as zeros: padding rows are written by none)
        outputs = (jnp.zeros((vectors_out, d), q.dtype),)
    else:  # each split's accumulator, running maximum and sum (rows no program writes: empty)
        outputs = (jnp.zeros((splits * vectors_out, d), jnp.float32),
                   jnp.full((splits * vectors_out,), NEG_INF, jnp.float32),
                   jnp.zeros((splits * vectors_out,), jnp.float32))
    # Row-major views: query vector ``row * h + head``, cache row
    # ``((layer * S + slot) * M + position) * KVH + kv_head``; both reshapes are free.
    inputs = (q.reshape(n * h, d), k_cache.reshape(-1, d), v_cache.reshape(-1, d),
              occupied.astype(jnp.int32), layout.first_row.astype(jnp.int32),
              layout.row_count.astype(jnp.int32), jnp.asarray(kv_len, jnp.int32),
              jnp.asarray(layer, jnp.int32).reshape(1))
    out = pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outputs],
        grid=(pl.cdiv(block_size * group, block_m), kv_heads, len(occupied) * splits),
        input_output_aliases={len(inputs) + i: i for i in range(len(outputs))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="ragged_attention",
    )(*inputs, *outputs)
    if splits == 1:
        out = out[0]
    else:  # the softmax over all splits, from each split's statistics
        acc, maximum, exp_sum = (x.reshape(splits, vectors_out, *x.shape[1:]) for x in out)
        weight = jnp.exp(maximum - maximum.max(axis=0))
        total = (weight * exp_sum).sum(axis=0)
        out = ((weight[..., None] * acc).sum(axis=0)
               / jnp.where(total > 0, total, 1.0)[:, None]).astype(q.dtype)
    return out[:n * h].reshape(n, h, d)


def _kernel(q_ref, k_ref, v_ref, occupied_ref, first_row_ref, row_count_ref, kv_len_ref,
            layer_ref, *refs, spare: int, vectors_out: int, slots: int, positions: int,
            kv_heads: int, group: int, splits: int, block_m: int, block_n: int, scale: float,
            precision: jax.lax.Precision):
    # refs: the aliased initial outputs, then the outputs (out; or acc, maximum, exp_sum).
    outs = refs[len(refs) // 2:]
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) % splits
    slot = occupied_ref[pl.program_id(2) // splits]
    has_slot = slot < slots
    slot = jnp.minimum(slot, slots - 1)  # past the occupied slots: no rows, nothing read
    count = jnp.where(has_slot, row_count_ref[slot], 0)
    first = first_row_ref[slot]
    layer = layer_ref[0]

    i = tile * block_m + jnp.arange(block_m, dtype=jnp.int32)  # query vector = row * group + head
    row = i // group
    row_ok = row < count
    vector = jnp.where(row_ok, (first + row) * (kv_heads * group) + kv_head * group + i % group,
                       spare)
    # Every index an array (rows x head dims): the interpreter gathers only such indexers.
    dims = jnp.arange(q_ref.shape[-1], dtype=jnp.int32)[None, :]
    q = plgpu.load(q_ref.at[vector[:, None], dims], mask=row_ok[:, None], other=0.0)

    # A tile without rows walks no cache; a split walks its share of the slot's blocks.
    kv_len = jnp.where(tile * block_m < count * group, kv_len_ref[slot], 0)
    blocks = pl.cdiv(kv_len, block_n)
    share = pl.cdiv(blocks, splits)
    lo = split * share
    hi = jnp.maximum(jnp.minimum(lo + share, blocks), lo)
    cache_row = (layer * slots + slot) * positions

    def block(j, carry):
        m_i, l_i, acc = carry
        position = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
        visible = position < kv_len
        kv_row = jnp.where(visible, (cache_row + position) * kv_heads + kv_head, 0)
        k = plgpu.load(k_ref.at[kv_row[:, None], dims], mask=visible[:, None], other=0.0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible[None, :], s, NEG_INF)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m_i - m_new)
        l_i = l_i * correction + jnp.sum(p, axis=1)
        v = plgpu.load(v_ref.at[kv_row[:, None], dims], mask=visible[:, None], other=0.0)
        acc = acc * correction[:, None] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
        return m_new, l_i, acc

    start = (jnp.full((block_m,), NEG_INF, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, q_ref.shape[-1]), jnp.float32))
    m_i, l_i, acc = jax.lax.fori_loop(lo, hi, block, start)
    if splits == 1:
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(outs[0].at[vector[:, None], dims], out.astype(outs[0].dtype),
                    mask=row_ok[:, None])
        return
    at = split * vectors_out + vector
    acc_ref, maximum_ref, exp_sum_ref = outs
    plgpu.store(acc_ref.at[at[:, None], dims], acc, mask=row_ok[:, None])
    plgpu.store(maximum_ref.at[at], m_i, mask=row_ok)
    plgpu.store(exp_sum_ref.at[at], l_i, mask=row_ok)
