"""The FOCUS policy against the NumPy reference, and eviction inside the decode step."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focus_jax import GenerationConfig, generate
from focus_jax import focus as policy
from focus_jax.decoding import MASKED, step
from focus_jax.engine import Engine
from focus_jax.testing import random_prompts
from tests import focus_reference as ref

BLOCK_SIZES = (4, 8, 16, 32, 64)

# Compiled whole, as the step runs them (op by op, each case took seconds of small compiles).
importance = jax.jit(policy.importance)
select_retained = jax.jit(policy.select_retained)


def random_masks(rng, slots, b):
    """Masks of every density, plus all masked and none masked."""
    density = rng.uniform(0, 1, size=(slots, 1))
    masked = rng.uniform(size=(slots, b)) < density
    masked[0] = True
    masked[1] = False
    return masked


@pytest.mark.parametrize("b", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_importance_matches_numpy_reference(b, heads, kv_heads):
    rng = np.random.default_rng(b * 10 + heads + kv_heads)
    slots, d = 12, 16
    q = rng.normal(size=(slots, b, heads, d)).astype(np.float32) * 2
    k = rng.normal(size=(slots, b, kv_heads, d)).astype(np.float32) * 2
    masked = random_masks(rng, slots, b)
    got = np.asarray(importance(jnp.asarray(q), jnp.asarray(k), jnp.asarray(masked)))
    want = np.stack([ref.importance(q[i], k[i], masked[i]) for i in range(slots)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Each masked query spreads a total probability of 1 per head.
    np.testing.assert_allclose(got.sum(-1), masked.sum(-1) * heads, rtol=1e-5)


def test_importance_pools_over_neighbours_in_the_masked_list_not_raw_slots():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 8, 2, 4)).astype(np.float32)
    k = rng.normal(size=(1, 8, 2, 4)).astype(np.float32)
    masked = np.array([[True, False, False, True, False, True, True, False]])
    got = np.asarray(importance(jnp.asarray(q), jnp.asarray(k), jnp.asarray(masked)))[0]
    np.testing.assert_allclose(got, ref.importance(q[0], k[0], masked[0]), rtol=1e-5)
    assert (got[~masked[0]] == 0).all()


def deltas(rng, kind, slots, b):
    if kind == "continuous":
        return rng.normal(size=(slots, b)).astype(np.float32)
    if kind == "ties":  # small integers: many exact ties, sums exact in float32
        return rng.integers(-2, 3, size=(slots, b)).astype(np.float32)
    return np.full((slots, b), 0.375, np.float32)  # all equal


@pytest.mark.parametrize("b", BLOCK_SIZES)
@pytest.mark.parametrize("kind", ["continuous", "ties", "equal"])
@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.5])
def test_select_retained_matches_numpy_reference(b, kind, alpha):
    rng = np.random.default_rng(b + int(alpha * 10) + len(kind))
    slots = 64
    delta = deltas(rng, kind, slots, b)
    masked = random_masks(rng, slots, b)
    progress = rng.integers(-1, b, size=slots).astype(np.int32)
    progress[:8] = -1  # block start
    avg = rng.choice([1.0, 1.5, 4 / 3, 2.0, 3.7, 9.0], size=slots).astype(np.float32)
    got = np.asarray(select_retained(jnp.asarray(delta), jnp.asarray(masked),
                                     jnp.asarray(progress), jnp.asarray(avg), alpha))
    want = np.stack([ref.select_retained(delta[i], masked[i], int(progress[i]), float(avg[i]), alpha)
                     for i in range(slots)])
    np.testing.assert_array_equal(got, want)
    assert not (got & ~masked).any()


def test_selection_cases_by_hand():
    sel = functools.partial(select_retained, alpha=1.0)
    one = lambda *rows: jnp.asarray([rows])
    # L <= K: nothing evicted.
    got = sel(one(0.0, 5.0), one(True, True), jnp.array([-1]), jnp.array([2.0]))
    assert np.asarray(got).tolist() == [[True, True]]
    # Top-1 by delta (avg 1, alpha 1), then the unprocessed prefix up to it is kept (progress -1).
    got = sel(one(0.0, 0.1, 3.0, 0.2), one(True, True, True, True), jnp.array([-1]), jnp.array([1.0]))
    assert np.asarray(got).tolist() == [[True, True, True, False]]
    # Mid-block (progress 2): no prefix; slot 1 joins through adjacency to slot 2 (retained).
    got = sel(one(0.0, 0.1, 3.0, 0.2), one(True, True, True, True), jnp.array([2]), jnp.array([1.0]))
    assert np.asarray(got).tolist() == [[False, True, True, False]]
    # Adjacency needs the next masked slot to be the next slot: a gap breaks it.
    got = sel(one(0.0, 0.1, 0.0, 3.0), one(True, True, False, True), jnp.array([3]), jnp.array([1.0]))
    assert np.asarray(got).tolist() == [[False, False, False, True]]
    # Nothing masked: nothing retained.
    got = sel(one(1.0, 2.0), one(False, False), jnp.array([-1]), jnp.array([1.0]))
    assert np.asarray(got).tolist() == [[False, False]]


CONFIG = dict(block_size=8, threshold=0.04, max_new_tokens=24, stop_token_ids=(),
              bucket_ladder=(0.25, 1.0))


@pytest.mark.parametrize("commit_refresh", [False, True])
def test_focus_with_huge_alpha_matches_delayed(model, commit_refresh):
    prompts = random_prompts(5, 128, 2, 20, seed=11)
    config = dict(CONFIG, commit_refresh=commit_refresh)
    delayed = generate(model, prompts, GenerationConfig(mode="delayed", **config))
    focus = generate(model, prompts, GenerationConfig(mode="focus", alpha=8.0, **config))
    for a, b in zip(delayed, focus, strict=True):
        assert a.token_ids == b.token_ids
        assert a.stats.processed_per_step == b.stats.processed_per_step
        assert b.stats.retained_per_step == b.stats.processed_per_step


def test_delayed_cache_processes_fewer_tokens_than_baseline(model):
    prompts = random_prompts(4, 128, 2, 20, seed=12)
    baseline = generate(model, prompts, GenerationConfig(mode="baseline", **CONFIG))
    delayed = generate(model, prompts, GenerationConfig(mode="delayed", **CONFIG))
    processed = lambda rs: sum(sum(r.stats.processed_per_step) for r in rs)
    assert processed(delayed) < processed(baseline)
    assert all(p == 8 for r in baseline for p in r.stats.processed_per_step)


def test_evicted_slots_stay_masked_and_are_never_decoded(model):
    config = GenerationConfig(mode="focus", alpha=1.0, **CONFIG)
    engine = Engine(model, config, slots=4, cache_len=64)
    for prompt in random_prompts(4, 128, 2, 20, seed=13):
        engine.add_request(prompt)
    for batch in engine.scheduler.batches(engine.scheduler.admit()[0], engine.runner.prefill_batch):
        engine.runner.prefill(batch)
    run_step = jax.jit(functools.partial(step, model.module(), settings=engine.settings))
    state, evictions = engine.state, 0
    for _ in range(40):
        before = np.asarray(state.slot_state)
        state, log = run_step(state)
        after = np.asarray(state.slot_state)
        history_moved = np.asarray(log.live) & ~(before == MASKED).any(-1)  # commit steps
        evicted = np.asarray(log.processed) & (before == MASKED) & ~np.asarray(log.retained)
        assert not (evicted & np.asarray(log.decoded)).any()
        assert (after[evicted & ~history_moved[:, None]] == MASKED).all()
        # The LM head ran on exactly the retained masks of slots still decoding.
        decoding = np.asarray(log.live) & (before == MASKED).any(-1)
        sampled = np.asarray(log.sampled)
        assert (sampled == (np.asarray(log.retained) & (before == MASKED) & decoding[:, None])).all()
        assert (np.asarray(log.decoded) <= sampled).all()
        evictions += int(evicted.sum())
    assert evictions > 0  # the batch really evicted


def test_focus_skips_layers_for_evicted_tokens(model):
    prompts = random_prompts(4, 128, 2, 20, seed=14)
    results = generate(model, prompts, GenerationConfig(mode="focus", alpha=1.0, **CONFIG))
    processed = sum(sum(r.stats.processed_per_step) for r in results)
    retained = sum(sum(r.stats.retained_per_step) for r in results)
    assert retained < processed


def test_the_commit_refresh_runs_every_slot_of_the_block_through_every_layer(model):
    """With FOCUS evicting, a commit step with the refresh still runs all B slots through every
    layer: eviction applies to masked tokens only, and a committing block has none."""
    prompts = random_prompts(4, 128, 2, 20, seed=14)
    config = GenerationConfig(mode="focus", alpha=1.0, commit_refresh=True, **CONFIG)
    results = generate(model, prompts, config)
    for r in results:
        commits = r.stats.steps - r.stats.denoising_steps
        assert commits >= 2
        assert r.stats.processed_tokens - sum(r.stats.processed_per_step) == 8 * commits
        assert r.stats.retained_tokens - sum(r.stats.retained_per_step) == 8 * commits
    assert any(sum(r.stats.retained_per_step) < sum(r.stats.processed_per_step)
               for r in results)  # the denoising steps evicted


@functools.partial(jax.jit, static_argnames=("eviction", "buckets"))
def _retained_both_ways(eviction, state, processed, masked, first_layers, buckets):
    """What the step retains (the evicting slots compacted into a slot bucket) and what the
    policy retains over every slot's block: one program for every case of the test below (run
    op by op, its hundreds of small ops compiled one by one took most of a minute)."""
    from focus_jax import decoding
    from focus_jax.compaction import Compaction

    rows = Compaction(processed.reshape(-1), (processed.size,))
    got = decoding._retained(eviction, state, processed, masked, rows, first_layers, buckets)
    want = eviction.retained(
        processed, masked,
        tuple(rows.to_flat(a).reshape(*processed.shape, *a.shape[1:]) for a in first_layers),
        state.progress, decoding.decoded_per_step(state), state.params.alpha)
    return got, want


@pytest.mark.parametrize("live", [0, 1, 3, 16])
def test_eviction_on_the_evicting_slots_alone_equals_eviction_over_every_slot(live):
    """The step runs the eviction policy on the slots that have masked processed tokens,
    compacted into a slot bucket, with their queries and keys gathered from the processed rows'
    compact order. It must retain exactly what the policy retains over every slot's block."""
    from focus_jax import decoding
    from focus_jax.policies import FocusEviction
    from focus_jax.testing import tiny_model

    rng = np.random.default_rng(live)
    slots, b, heads, kv_heads, d = 16, 8, 4, 2, 16
    cfg = tiny_model(block_size=b).config
    state = decoding.init_state(cfg, slots, 4 * b, b, 0)
    active = np.zeros(slots, bool)
    active[rng.choice(slots, live, replace=False)] = True
    masked = (rng.uniform(size=(slots, b)) < 0.8) & active[:, None]
    processed = (masked | (rng.uniform(size=(slots, b)) < 0.3)) & active[:, None]
    state = dataclasses.replace(
        state, progress=jnp.asarray(rng.integers(b // 2, b, slots), jnp.int32),
        block_steps=jnp.asarray(rng.integers(0, 3, slots), jnp.int32),
        block_decoded=jnp.asarray(rng.integers(0, 5, slots), jnp.int32),
        params=dataclasses.replace(state.params,
                                   alpha=jnp.asarray(rng.choice([1.0, 1.5], slots),
                                                     jnp.float32)))
    count = int(processed.sum())
    # The first layers' queries and keys in compact order: the processed rows first, then
    # padding (what the step hands on).
    shapes = [(heads, d), (kv_heads, d), (heads, d), (kv_heads, d)]
    first_layers = tuple(
        jnp.asarray(np.concatenate([rng.normal(size=(count, *shape)),
                                    np.zeros((slots * b - count, *shape))]), jnp.float32)
        for shape in shapes)
    got, want = _retained_both_ways(FocusEviction(kernels="xla"), state, jnp.asarray(processed),
                                    jnp.asarray(masked), first_layers, (2, 4, 8, slots))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not (np.asarray(got) & ~processed).any()
    if live:
        assert (np.asarray(got) != processed).any()  # something was evicted
