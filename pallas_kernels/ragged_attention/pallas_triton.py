"""Ragged attention as a Pallas kernel for NVIDIA GPUs, through Pallas's Triton backend.

The algorithm and launch shape of :mod:`.triton_gpu`: a grid of ``(query tile, KV head, slot)``;
a program stacks its slot's compacted rows times the query heads of its KV head and walks that
slot's cache of the layer in blocks of ``block_n`` positions with an online softmax (float32
statistics and accumulator). What differs is how it reaches XLA. jax-triton hands XLA an opaque
custom call, which ends every CUDA command buffer XLA records around it (a lightly loaded decode
step launches about 1,200 kernels and loses about 3 ms to the gaps between them,
docs/serving.md). This kernel becomes XLA's own Triton custom call (``__gpu$xla.gpu.triton``),
which XLA compiles with the program, so the kernels around it can stay in one command buffer.

Not the GPU default yet: its GPU tests pass on the H200 and it serves (``--kernels
pallas_triton``), faster than the jax-triton kernel at light load and no slower at batch 256
(docs/serving.md); the engine's GPU tests have not run with it as the default. Splitting each
slot's cache walk over several programs was measured and removed (docs/kernels.md): the grid
covers every slot, so a split multiplies the programs that find no rows. JAX 0.11 marks
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

from pallas_kernels.ragged_attention.reference import BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, gpu_layout

NEG_INF = -1e30


def ragged_attention(q: Float[Array, "n h d"], rows: Int[Array, "n"], valid: Bool[Array, "n"],
                     k_cache: Float[Array, "layers s m kvh d"],
                     v_cache: Float[Array, "layers s m kvh d"], layer: Int[Array, ""] | int,
                     kv_len: Int[Array, "s"], *, block_size: int,
                     block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                     num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                     interpret: bool = False) -> Float[Array, "n h d"]:
    """Same contract as :func:`pallas_kernels.ragged_attention.reference.ragged_attention`
    (padding rows come back zero). ``interpret``: run in the Pallas interpreter (any platform)."""
    n, h, d = q.shape
    _, slots, positions, kv_heads, _ = k_cache.shape
    group, first_row, row_count, block_m = gpu_layout(q, rows, valid, k_cache, v_cache,
                                                      block_size, block_m)
    # Lanes without a row load and store at ``spare``. A masked store writes nothing on the GPU,
    # so row 0 serves there; the interpreter stores masked lanes back (read, select, write), so
    # a lane without a row must not share a row with one that has it: a spare row past the end.
    vectors_out = n * h + (1 if interpret else 0)
    kernel = functools.partial(
        _kernel, spare=vectors_out - 1 if interpret else 0,
        slots=slots, positions=positions, kv_heads=kv_heads, group=group,
        block_m=block_m, block_n=block_n, scale=d ** -0.5,
        precision=(jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                   else jax.lax.Precision.DEFAULT))
    # Row-major views: query vector ``row * h + head``, cache row
    # ``((layer * S + slot) * M + position) * KVH + kv_head``; both reshapes are free.
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((vectors_out, d), q.dtype),
        grid=(pl.cdiv(block_size * group, block_m), kv_heads, slots),
        # The output starts as zeros (the last operand): padding rows are written by no program.
        input_output_aliases={7: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="ragged_attention",
    )(q.reshape(n * h, d), k_cache.reshape(-1, d), v_cache.reshape(-1, d),
      first_row.astype(jnp.int32), row_count.astype(jnp.int32), jnp.asarray(kv_len, jnp.int32),
      jnp.asarray(layer, jnp.int32).reshape(1), jnp.zeros((vectors_out, d), q.dtype))
    return out[:n * h].reshape(n, h, d)


def _kernel(q_ref, k_ref, v_ref, first_row_ref, row_count_ref, kv_len_ref, layer_ref, _zeros_ref,
            out_ref, *, spare: int, slots: int, positions: int, kv_heads: int, group: int, block_m: int,
            block_n: int, scale: float, precision: jax.lax.Precision):
    tile, kv_head, slot = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    count = row_count_ref[slot]
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

    # A tile without rows walks no cache.
    kv_len = jnp.where(tile * block_m < count * group, kv_len_ref[slot], 0)
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
    _, l_i, acc = jax.lax.fori_loop(0, pl.cdiv(kv_len, block_n), block, start)
    out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    plgpu.store(out_ref.at[vector[:, None], dims], out.astype(out_ref.dtype),
                mask=row_ok[:, None])
