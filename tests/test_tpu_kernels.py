"""The TPU kernels compile with the real TPU compilers (Mosaic and XLA) for v5e, v6e and v5p.

Nothing runs: with libtpu, XLA compiles for a TPU topology's devices on this CPU machine
(``focus_jax.tpu``; DESIGN.md section 11). The Pallas interpreter accepts block shapes and
layouts that Mosaic rejects, so only these compiles prove the kernels; their numerics are held
to the references in ``test_kernels.py``.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from focus_jax import compilation, tpu
from pallas_kernels.focus_importance import focus_importance, focus_importance_sharded
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_attention import ragged_attention, ragged_attention_sharded

pytestmark = pytest.mark.skipif(not tpu.libtpu_installed(),
                                reason=f"libtpu is not installed ({tpu.INSTALL_HINT})")

ONE_CHIP = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "v5p": "v5p:1x1x1"}
DTYPES = [jnp.bfloat16, jnp.float32]
# (query heads, KV heads, head dim, block size, slots, cache positions): an SDAR-like layer
# (GQA group 2, head dim 128; bf16 tiles of 32 rows) and the tiny test model's.
GEOMETRIES = {"sdar-like": (16, 8, 128, 16, 4, 256), "tiny": (4, 2, 16, 4, 4, 64)}


@functools.cache
def one_chip_mesh(generation: str) -> Mesh:
    return tpu.make_mesh(tpu.parse_topology(ONE_CHIP[generation]), 1, 1)


def compile_for(mesh: Mesh, f, *inputs: tuple[tuple[int, ...], object, P]) -> str:
    """Compile ``f`` for abstract ``(shape, dtype, spec)`` inputs on ``mesh``; its lowered
    program's text. Lowering runs under the mesh: Mosaic's lowering asks it for the chip. Not
    written to the persistent cache: no process could load it back."""
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
            for shape, dtype, spec in inputs]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), compilation.not_persisted():
        lowered = jax.jit(f).lower(*args)
        lowered.compile()
    return lowered.as_text()


def attention_inputs(geometry: str, dtype, cache_spec: P | None = None) -> list:
    heads, kv_heads, head_dim, block, slots, positions = GEOMETRIES[geometry]
    rows = slots * block // 2
    cache = ((2, slots, positions, kv_heads, head_dim), dtype, cache_spec or P())
    return [((rows, heads, head_dim), dtype, P()), ((rows,), jnp.int32, P()),
            ((rows,), jnp.bool_, P()), cache, cache, ((slots,), jnp.int32, P())]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("generation", ONE_CHIP)
def test_ragged_attention_kernel_compiles_for_one_chip(generation, geometry, dtype):
    block = GEOMETRIES[geometry][3]

    def attend(q, rows, valid, k, v, kv_len):
        return ragged_attention(q, rows, valid, k, v, 1, kv_len, block_size=block,
                                impl="pallas_tpu")

    text = compile_for(one_chip_mesh(generation), attend, *attention_inputs(geometry, dtype))
    assert "tpu_custom_call" in text  # the Mosaic kernel, not an XLA stand-in


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("generation", ONE_CHIP)
def test_paged_attention_kernel_compiles_for_one_chip(generation, geometry, dtype):
    heads, kv_heads, head_dim, block, slots, positions = GEOMETRIES[geometry]
    rows, width = slots * block // 2, positions // block
    pool = ((2, slots * width, block, kv_heads, head_dim), dtype, P())

    def attend(q, rows, valid, k, v, table, kv_len):
        return paged_attention(q, rows, valid, k, v, table, 1, kv_len, block_size=block,
                               impl="pallas_tpu")

    text = compile_for(one_chip_mesh(generation), attend, ((rows, heads, head_dim), dtype, P()),
                       ((rows,), jnp.int32, P()), ((rows,), jnp.bool_, P()), pool, pool,
                       ((slots, width), jnp.int32, P()), ((slots,), jnp.int32, P()))
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("generation", ONE_CHIP)
def test_focus_importance_kernel_compiles_for_one_chip(generation, geometry, dtype):
    heads, kv_heads, head_dim, block, slots, _ = GEOMETRIES[geometry]
    text = compile_for(one_chip_mesh(generation),
                       functools.partial(focus_importance, impl="pallas_tpu"),
                       ((slots, block, heads, head_dim), dtype, P()),
                       ((slots, block, kv_heads, head_dim), dtype, P()),
                       ((slots, block), jnp.bool_, P()))
    assert "tpu_custom_call" in text


def test_sharded_entry_points_compile_inside_the_steps_shard_map_on_v5e_2x4():
    """As the decode step calls them on data=2, model=4: inside a ``shard_map`` over ``data``
    (each shard's own compacted rows), the entry points make ``model`` manual."""
    mesh = tpu.make_mesh(tpu.parse_topology("v5e:2x4"), 2, 4)
    heads, _, head_dim, block, slots, _ = GEOMETRIES["sdar-like"]
    dtype = jnp.bfloat16
    cache = attention_inputs("sdar-like", dtype, cache_spec=P(None, "data", None, "model"))[3]
    local_rows = slots // 2 * block  # a bucket of every row of the shard's slots

    def per_shard(q, rows, valid, k, v, kv_len):
        attn = ragged_attention_sharded(mesh, q, rows, valid, k, v, 1, kv_len,
                                        block_size=block, impl="pallas_tpu")
        blocks = attn.reshape(slots // 2, block, heads, head_dim)
        importance = focus_importance_sharded(mesh, blocks, blocks[:, :, ::2],
                                              valid.reshape(slots // 2, block),
                                              impl="pallas_tpu")
        return attn, importance

    def step(q, rows, valid, k, v, kv_len):
        cache_spec = P(None, "data")
        return jax.shard_map(per_shard, mesh=mesh, axis_names={"data"},
                             in_specs=(P("data"),) * 3 + (cache_spec, cache_spec, P("data")),
                             out_specs=(P("data"), P("data")))(q, rows, valid, k, v, kv_len)

    text = compile_for(mesh, step, ((2 * local_rows, heads, head_dim), dtype, P("data", "model")),
                       ((2 * local_rows,), jnp.int32, P("data")),
                       ((2 * local_rows,), jnp.bool_, P("data")), cache, cache,
                       ((slots,), jnp.int32, P("data")))
    assert text.count("tpu_custom_call") >= 2  # attention and importance, both Mosaic



# (rows, k, n, experts): SDAR-30B-A3B's gate-up projection at 2,048 rows (tokens x top-8), its
# down projection at 200 rows (no multiple of a tile), and a tiny one with k and n under 128.
EXPERT_SHAPES = {"gate_up": (2048, 2048, 1536, 128), "down": (200, 768, 2048, 128),
                 "tiny": (40, 64, 96, 4)}


def compile_grouped_matmul(generation: str, shape: str, dtype) -> str:
    rows, k, n, experts = EXPERT_SHAPES[shape]
    return compile_for(one_chip_mesh(generation), grouped_matmul, ((rows, k), dtype, P()),
                       ((experts, k, n), dtype, P()), ((experts,), jnp.int32, P()))


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is None, reason="tokamax is not installed")
@pytest.mark.parametrize(("generation", "shape"), [("v5e", "gate_up"), ("v5e", "tiny"),
                                                   ("v5e", "down"), ("v6e", "down"),
                                                   ("v5p", "down")])
def test_grouped_matmul_default_is_tokamaxs_kernel_for_one_chip(generation, shape):
    """bf16, no ``impl``: the dispatch sees the TPU through the abstract mesh and picks
    tokamax's GMM v2, which compiles at any row count."""
    assert "tpu_custom_call" in compile_grouped_matmul(generation, shape, jnp.bfloat16)


def test_grouped_matmul_in_float32_is_xlas_ragged_dot_for_one_chip():
    """tokamax's float32 tiling outgrows a v5p's VMEM at this shape: float32 stays with XLA."""
    assert "tpu_custom_call" not in compile_grouped_matmul("v5p", "gate_up", jnp.float32)
