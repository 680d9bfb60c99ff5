"""Kernels against their pure-jnp references.

TPU kernels run in the Pallas TPU interpreter on any machine (CI: the CPU). GPU kernels run only
on an NVIDIA GPU with jax-triton installed; on the H200:
``make test-gpu``.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focus_jax import GenerationConfig, generate
from focus_jax.compaction import compact
from focus_jax.testing import random_prompts
from pallas_kernels.focus_importance import focus_importance
from pallas_kernels.focus_importance import reference as importance_reference
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention import reference as paged_reference
from pallas_kernels.ragged_attention import ragged_attention
from pallas_kernels.ragged_attention import reference as attention_reference

# (query heads per KV head, head dim, block size): every GQA group, both head dims, B 4..64.
SHAPES = [(1, 64, 4), (2, 128, 8), (4, 64, 16), (8, 128, 32), (2, 64, 64)]
HEADS = 8


def whole(fn, *args, **settings):
    """``fn(*args, **settings)`` compiled as one program (``settings`` static), as a caller's
    step runs it: op by op, every case compiled each of its small ops for its shapes."""
    return jax.jit(functools.partial(fn, **settings))(*args)

ON_GPU = jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(
    not ON_GPU, reason="the Triton kernels need an NVIDIA GPU and jax-triton")]
IMPLS = ["pallas_tpu_interpret", pytest.param("triton", marks=GPU_MARKS)]
# Ragged attention also has a Pallas Triton kernel: its numbers in the interpreter here, its
# lowering to Triton below, both on any machine; compiled and run on the GPU.
ON_CUDA = jax.default_backend() == "gpu"
CUDA_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU")]
ATTENTION_IMPLS = [*IMPLS, "pallas_triton_interpret",
                   pytest.param("pallas_triton", marks=CUDA_MARKS)]



def cases(bf16_tolerance: float, pallas_triton: bool = False) -> list:
    """(impl, dtype, tolerance): every kernel in float32 and in bf16 (the engine's dtype,
    float32 accumulation on both sides), against the reference on the same bf16 inputs."""
    found = [("pallas_tpu_interpret", jnp.float32, 2e-5),
             ("pallas_tpu_interpret", jnp.bfloat16, bf16_tolerance),
             pytest.param("triton", jnp.float32, 2e-5, marks=GPU_MARKS),
             pytest.param("triton", jnp.bfloat16, bf16_tolerance, marks=GPU_MARKS)]
    if pallas_triton:  # ragged attention's other kernels
        found += [("pallas_triton_interpret", jnp.float32, 2e-5),
                  ("pallas_triton_interpret", jnp.bfloat16, bf16_tolerance),
                  pytest.param("pallas_triton", jnp.float32, 2e-5, marks=CUDA_MARKS),
                  pytest.param("pallas_triton", jnp.bfloat16, bf16_tolerance, marks=CUDA_MARKS)]
    return found


@pytest.mark.parametrize(("impl", "dtype", "tolerance"), cases(bf16_tolerance=1e-3))
@pytest.mark.parametrize(("group", "head_dim", "block"), SHAPES)
def test_importance_kernel_matches_reference(group, head_dim, block, impl, dtype, tolerance):
    rng = np.random.default_rng(group * 1000 + head_dim + block)
    slots = 5
    q = jnp.asarray(rng.normal(size=(slots, block, HEADS, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(slots, block, HEADS // group, head_dim)), dtype)
    masked = rng.uniform(size=(slots, block)) < rng.uniform(0.2, 0.9, size=(slots, 1))
    masked[0], masked[1] = True, False  # every slot masked; none masked
    masked = jnp.asarray(masked)
    got = whole(focus_importance, q, k, masked, impl=impl)
    want = whole(importance_reference.importance, q, k, masked)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("impl", "dtype", "tolerance"),
                         cases(bf16_tolerance=2e-2, pallas_triton=True))
@pytest.mark.parametrize(("group", "head_dim", "block"), SHAPES)
def test_ragged_attention_kernel_matches_reference(group, head_dim, block, impl, dtype,
                                                   tolerance):
    rng = np.random.default_rng(group * 100 + head_dim + block)
    layers, slots, positions = 2, 5, 256
    kv_heads = HEADS // group
    cache = [jnp.asarray(rng.normal(size=(layers, slots, positions, kv_heads, head_dim)),
                         dtype) for _ in range(2)]
    keep = rng.uniform(size=(slots, block)) < 0.5
    keep[0], keep[1] = True, False          # a slot with every row, a slot with none
    kv_len = rng.integers(1, positions + 1, size=slots)
    kv_len[1], kv_len[2] = 0, positions     # 0 where there are no rows; the maximum
    kv_len[0] = 1
    rows, count = compact(jnp.asarray(keep.reshape(-1)))
    size = int(count) + 3                   # a bucket with padding rows past the count
    rows, valid = rows[:size], jnp.arange(size) < count
    q = jnp.asarray(rng.normal(size=(size, HEADS, head_dim)), dtype)
    args = (q, rows, valid, *cache, 1, jnp.asarray(kv_len))
    options = {"block_kv": 64} if impl.startswith("pallas_tpu") else {}
    got = whole(ragged_attention, *args, block_size=block, impl=impl, **options)
    want = whole(attention_reference.ragged_attention, *args, block_size=block)
    if not impl.endswith("interpret"):  # the rows' slot layout computed by the caller
        layout = attention_reference.slot_layout(rows, valid, slots, block)
        given = ragged_attention(*args, block_size=block, impl=impl, layout=layout, **options)
        np.testing.assert_array_equal(np.asarray(given), np.asarray(got))
    valid = np.asarray(valid)
    assert valid.sum() > 0 and (~valid).sum() > 0
    got, want = (np.asarray(a.astype(jnp.float32)) for a in (got, want))
    np.testing.assert_allclose(got[valid], want[valid], rtol=tolerance, atol=tolerance)


# The smallest and largest GQA groups and blocks (the interpreter takes seconds per case).
PAGED_SHAPES = [SHAPES[0], SHAPES[3], SHAPES[4]]


@pytest.mark.parametrize(("impl", "dtype", "tolerance"), cases(bf16_tolerance=2e-2))
@pytest.mark.parametrize(("group", "head_dim", "block"), PAGED_SHAPES)
def test_paged_attention_kernel_matches_reference_with_holes_reordered_and_shared_pages(
        group, head_dim, block, impl, dtype, tolerance):
    """Slots hold pages of a shuffled pool, two slots share their leading pages (a cached
    prefix), and table entries past a slot's length are holes or garbage (never read); KV
    blocks of three pages, so the last block of a full slot runs past its table."""
    rng = np.random.default_rng(group * 100 + head_dim + block + 1)
    layers, slots, width = 2, 5, 8
    kv_heads = HEADS // group
    pages = slots * width
    pool = [jnp.asarray(rng.normal(size=(layers, pages, block, kv_heads, head_dim)), dtype)
            for _ in range(2)]
    table = rng.permutation(pages).reshape(slots, width).astype(np.int32)
    table[3, :2] = table[0, :2]             # slot 3 shares slot 0's first two pages
    kv_len = rng.integers(1, width * block + 1, size=slots)
    kv_len[1], kv_len[2], kv_len[3] = 0, width * block, max(kv_len[3], 2 * block + 1)
    for slot in range(slots):               # past the length: holes and garbage
        used = -(-int(kv_len[slot]) // block)
        table[slot, used:] = rng.choice([pages, -1, 10**6], size=width - used)
    keep = rng.uniform(size=(slots, block)) < 0.5
    keep[0], keep[1], keep[3] = True, False, True  # a slot with every row, a slot with none
    rows, count = compact(jnp.asarray(keep.reshape(-1)))
    size = int(count) + 3                   # a bucket with padding rows past the count
    rows, valid = rows[:size], jnp.arange(size) < count
    q = jnp.asarray(rng.normal(size=(size, HEADS, head_dim)), dtype)
    args = (q, rows, valid, *pool, jnp.asarray(table), 1, jnp.asarray(kv_len))
    options = {"pages_per_block": 3} if impl.startswith("pallas_tpu") else {}
    got = whole(paged_attention, *args, block_size=block, impl=impl, **options)
    want = whole(paged_reference.paged_attention, *args, block_size=block)
    valid = np.asarray(valid)
    got, want = (np.asarray(a.astype(jnp.float32)) for a in (got, want))
    np.testing.assert_allclose(got[valid], want[valid], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("impl", ["pallas_triton_interpret",
                                  pytest.param("pallas_triton", marks=CUDA_MARKS)])
@pytest.mark.parametrize(("occupancy", "kv_splits"), [("few", None), ("few", 1), ("few", 3),
                                                      ("few", 16), ("one_row_each", None)])
def test_pallas_triton_attention_over_occupied_slots_matches_reference(impl, occupancy,
                                                                       kv_splits):
    """A light load: few rows in many slots. The grid covers only as many slots as the rows
    can occupy, and each slot's cache walk is shared by ``kv_splits`` programs (default: as
    many as keep the grid within one program per slot; 16 leaves some with nothing to walk).
    ``one_row_each``: every row in a slot of its own, as many occupied slots as the grid has."""
    rng = np.random.default_rng(7)
    layers, slots, positions, kv_heads, group, block, head_dim = 2, 16, 256, 2, 4, 8, 64
    cache = [jnp.asarray(rng.normal(size=(layers, slots, positions, kv_heads, head_dim)),
                         jnp.float32) for _ in range(2)]
    keep = np.zeros((slots, block), bool)
    if occupancy == "few":  # slots 3, 9 and 15: some rows, all rows, one row
        keep[3] = rng.uniform(size=block) < 0.5
        keep[9], keep[15, 2] = True, True
    else:
        keep[[0, 5, 6, 11, 14], [1, 0, 7, 3, 3]] = True
    kv_len = jnp.asarray(rng.integers(1, positions + 1, size=slots)).at[15].set(positions)
    rows, count = compact(jnp.asarray(keep.reshape(-1)))
    # Padding rows past the count; none for one row each: every program of the grid has a slot.
    size = int(count) + (2 if occupancy == "few" else 0)
    rows, valid = rows[:size], jnp.arange(size) < count
    q = jnp.asarray(rng.normal(size=(size, kv_heads * group, head_dim)), jnp.float32)
    args = (q, rows, valid, *cache, 1, kv_len)
    # The rows' slot layout as a caller that attends in several layers computes it once.
    layout = attention_reference.slot_layout(rows, valid, slots, block)
    assert np.asarray(layout.occupied).tolist() == (
        [3, 9, 15] + [slots] * (len(layout.occupied) - 3) if occupancy == "few"
        else [0, 5, 6, 11, 14])
    got = jax.jit(lambda *args, layout: ragged_attention(
        *args, block_size=block, impl=impl, kv_splits=kv_splits, layout=layout))(*args,
                                                                                 layout=layout)
    want = whole(attention_reference.ragged_attention, *args, block_size=block)
    valid = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=2e-5,
                               atol=2e-5)
    assert bool(jnp.isfinite(got).all())


def test_pallas_triton_attention_grid_shrinks_with_the_rows():
    from pallas_kernels.ragged_attention import pallas_triton

    occupied_slots, default_kv_splits = pallas_triton.occupied_slots, pallas_triton.default_kv_splits

    assert [occupied_slots(n, 256) for n in (1, 32, 256, 8192)] == [1, 32, 256, 256]
    # Split walks for the smallest buckets only (measured faster up to 32 rows, slower above).
    assert pallas_triton.SPLIT_MAX_ROWS == 32
    assert [default_kv_splits(n, 256) for n in (16, 32, 33, 64, 128, 256, 8192)] == [
        pallas_triton.MAX_KV_SPLITS, 4, 1, 1, 1, 1, 1]
    assert [default_kv_splits(n, 40) for n in (8, 16, 32)] == [4, 2, 1]
    # Never more programs along the slot axis than slots.
    assert all(occupied_slots(n, s) * default_kv_splits(n, s) <= max(s, 1)
               for n in range(1, 600, 7) for s in (1, 5, 64, 256))


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_ragged_attention_kernel_with_no_rows_returns_finite_values(impl):
    cache = jnp.ones((1, 2, 64, 1, 64), jnp.float32)
    q = jnp.ones((4, 2, 64), jnp.float32)
    out = ragged_attention(q, jnp.zeros(4, jnp.int32), jnp.zeros(4, bool), cache, cache, 0,
                           jnp.zeros(2, jnp.int32), block_size=4, impl=impl)
    assert out.shape == q.shape and bool(jnp.isfinite(out).all())


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_engine_with_kernels_decodes_like_the_xla_path(model, impl):
    prompts = random_prompts(3, 128, 2, 12, seed=3)
    config = GenerationConfig(mode="focus", block_size=4, threshold=0.04, alpha=1.0,
                              max_new_tokens=8, stop_token_ids=(), bucket_ladder=(0.5, 1.0))
    xla = [r.token_ids for r in generate(model, prompts, config.replace(kernels="xla"))]
    kernels = generate(model, prompts, config.replace(kernels=impl))
    assert [r.token_ids for r in kernels] == xla


def test_unknown_kernel_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown impl 'cuda'"):
        focus_importance(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)), jnp.ones((1, 4), bool),
                         impl="cuda")


def test_pallas_triton_attention_lowers_to_xlas_triton_call_for_an_h200():
    """The Pallas Triton kernel at SDAR-8B's attention shapes (32 query heads over 8 KV heads,
    head dim 128, block 32, bf16) lowers, on any machine, to the Triton custom call XLA compiles
    itself (which CUDA command buffers can hold), not to jax-triton's."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    from pallas_kernels.ragged_attention import pallas_triton

    rows, slots, positions = 96, 8, 256
    cache = jax.ShapeDtypeStruct((2, slots, positions, 8, 128), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((rows, 32, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), bool),
            cache, cache, jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((slots,), jnp.int32))
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    fn = jax.jit(lambda *a: pallas_triton.ragged_attention(*a, block_size=32))
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "triton_kernel_call" not in text
    assert 'name = "ragged_attention"' in text
