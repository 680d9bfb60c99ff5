"""Static-shape bucketed compaction: order, inverse, bucket choice and the default ladder."""

import jax.numpy as jnp
import numpy as np
import pytest

from focus_jax.compaction import Compaction, bucket_ladder
from focus_jax.config import DEFAULT_LADDER, GPU_LADDER


@pytest.mark.parametrize("seed", range(4))
def test_compact_order_puts_kept_rows_first_in_order_and_inverts(seed):
    rng = np.random.default_rng(seed)
    keep = rng.random(40) < rng.random()
    c = Compaction(jnp.asarray(keep), bucket_ladder(40, (0.25, 0.5, 1.0)))
    rows = np.asarray(c.rows)
    count = int(keep.sum())
    assert int(c.count) == count
    assert rows[:count].tolist() == np.flatnonzero(keep).tolist()
    assert sorted(rows.tolist()) == list(range(40))  # a permutation of the axis
    values = rng.normal(size=(40, 3)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(c.to_flat(jnp.asarray(values)[rows])), values)
    assert np.asarray(c.kept_in_order).tolist() == [i < count for i in range(40)]
    size = c.ladder[int(c.index)]
    assert size >= count and all(s < count for s in c.ladder[:int(c.index)])


def test_run_hands_each_bucket_its_rows_and_validity():
    keep = jnp.asarray([True, False, True, False, False, True, False, False])
    c = Compaction(keep, (2, 4, 8))

    def work(rows, valid, x):
        return jnp.pad(x[rows] * valid, (0, 8 - rows.shape[0]))

    out = np.asarray(c.run(work, jnp.arange(8.0) + 1))
    assert out.tolist() == [1, 3, 6, 0, 0, 0, 0, 0]  # bucket 4: three kept rows and one padding


def test_default_ladder_is_fine_where_focus_runs():
    sizes = bucket_ladder(8192, DEFAULT_LADDER)
    assert sizes[-1] == 8192 and len(sizes) == len(DEFAULT_LADDER) == 16
    # At most 1/32 of the axis between buckets up to a quarter, 1/16 up to a half, 1/8 above.
    steps = np.diff((0, *sizes))
    assert (steps[sizes.index(2048) + 1:sizes.index(4096) + 1] == 512).all()
    assert (steps[:sizes.index(2048) + 1] == 256).all() and (steps[-4:] == 1024).all()
    # GPUs add 64 and 128 rows below the smallest (a lightly loaded server's step).
    assert bucket_ladder(8192, GPU_LADDER) == (64, 128, *sizes)


def test_no_bucket_below_the_minimum_or_above_the_axis():
    assert bucket_ladder(64, GPU_LADDER) == (1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32,
                                             40, 48, 56, 64)
    assert bucket_ladder(64, GPU_LADDER, minimum=16) == (16, 20, 24, 28, 32, 40, 48, 56, 64)
    assert bucket_ladder(8, (0.25, 1.0), minimum=16) == (8,)


@pytest.mark.parametrize("kept", [1, 3, 7])
def test_run_in_place_runs_only_the_chosen_bucket_once(kept):
    keep = jnp.arange(8) < kept
    c = Compaction(keep, (2, 4, 8))

    def work(rows, valid, carry):
        total, runs, sizes = carry
        # Add the kept rows' values; record which bucket ran (its size) and how often.
        return total + jnp.sum(jnp.where(valid, rows + 1, 0)), runs + 1, sizes + rows.shape[0]

    total, runs, sizes = c.run_in_place(work, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))
    assert int(runs) == 1
    assert int(sizes) == next(size for size in (2, 4, 8) if size >= kept)
    assert int(total) == sum(range(1, kept + 1))


def test_gpu_settings_have_no_bucket_below_sixteen_rows():
    from focus_jax.config import GPU_MIN_BUCKET, GenerationConfig
    from focus_jax.engine.core import decode_settings

    gpu = decode_settings(GenerationConfig(block_size=8), 0, 8, "gpu")
    cpu = decode_settings(GenerationConfig(block_size=8, bucket_ladder=GPU_LADDER), 0, 8, "cpu")
    assert gpu.processed_ladder[0] == gpu.retained_ladder[0] == GPU_MIN_BUCKET == 16
    assert cpu.processed_ladder[0] == 1  # elsewhere the ladder is as configured
    assert gpu.retained_ladder == tuple(s for s in cpu.retained_ladder if s >= 16)


def test_gpu_processed_rows_have_a_coarser_ladder_of_their_own_unless_one_is_configured():
    """On GPUs the processed rows (layers 0-1) compact into the 9 rungs of
    GPU_PROCESSED_LADDER, the retained rows into GPU_LADDER's 18; a configured ladder is both."""
    from focus_jax.config import GPU_PROCESSED_LADDER, GenerationConfig
    from focus_jax.engine.core import decode_settings

    gpu = decode_settings(GenerationConfig(block_size=32), 0, 256, "gpu")
    assert gpu.processed_ladder == (64, 256, 1024, 2048, 4096, 5120, 6144, 7168, 8192)
    assert len(gpu.retained_ladder) == len(GPU_LADDER) == 18
    assert set(gpu.processed_ladder) < set(gpu.retained_ladder)
    assert len(GPU_PROCESSED_LADDER) == 9
    mine = decode_settings(GenerationConfig(block_size=32, bucket_ladder=(0.5, 1.0)), 0, 256,
                           "gpu")
    assert mine.processed_ladder == mine.retained_ladder == (4096, 8192)
    for platform in ("cpu", "tpu"):
        other = decode_settings(GenerationConfig(block_size=32), 0, 256, platform)
        assert other.processed_ladder == other.retained_ladder
