"""Static shapes: a long run compiles nothing after warm-up, and skipped work is really skipped
(XLA's compiled cost analysis of the decode step)."""

import contextlib
import dataclasses

import jax
import pytest
from jax import monitoring

from focus_jax import GenerationConfig
from focus_jax.decoding import DecodeState, step
from focus_jax.engine import Engine
from focus_jax.testing import random_prompts, tiny_model

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compilations():
    events = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            events.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("mode", ["baseline", "focus"])
def test_long_run_compiles_nothing_after_warmup(model, mode):
    config = GenerationConfig(mode=mode, block_size=4, threshold=0.04, max_new_tokens=12,
                              alpha=1.0)
    engine = Engine(model, config, slots=4, cache_len=64)
    with count_compilations() as warmup:
        engine.warmup()
    # One decode program (all bucket branches of both compactions inside it) and one prefill
    # program per prompt-length bucket.
    assert 1 <= len(warmup) <= 1 + len(engine_prompt_buckets(engine))
    with count_compilations() as serving:
        for prompt in random_prompts(14, 128, 1, 40, seed=21):  # more prompts than slots
            engine.submit(prompt)
        results = engine.run()
    assert len(results) == 14
    assert serving == []
    assert len(engine.stats.retained_buckets) > 1  # several buckets were really used


def engine_prompt_buckets(engine):
    from focus_jax.engine import prompt_buckets
    return prompt_buckets(engine.block_size, engine.cache_len)


def step_flops(model, mode, processed_ladder, retained_ladder, slots=8, block=8, cache=32):
    """FLOPs of one compiled decode step whose compactions can only pick the given buckets."""
    config = GenerationConfig(mode=mode, block_size=block, max_new_tokens=8)
    engine = Engine(model, config, slots=slots, cache_len=cache)
    # Unrolled, so that the cost analysis counts every layer (it counts a loop body once).
    settings = dataclasses.replace(engine.settings, processed_ladder=processed_ladder,
                                   retained_ladder=retained_ladder, unroll_layers=True)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), engine.state)
    assert isinstance(engine.state, DecodeState)
    lowered = jax.jit(lambda s: step(model.module(), s, settings)).lower(state)
    return lowered.compile().cost_analysis()["flops"]


@pytest.fixture(scope="module")
def deep_model():
    # Deep and wide enough that the layers, not the padded reference attention, dominate.
    return tiny_model(num_layers=12, hidden_size=64, intermediate_size=256)


def test_branch_flops_grow_with_the_bucket(deep_model):
    total = 64
    flops = [step_flops(deep_model, "focus", (total,), (n,)) for n in (2, 8, 32, 64)]
    assert flops == sorted(flops) and flops[0] < flops[-1] / 2


def test_focus_step_in_the_smallest_bucket_costs_a_third_of_baseline(deep_model):
    total = 64
    baseline = step_flops(deep_model, "baseline", (total,), (total,))
    focus = step_flops(deep_model, "focus", (total,), (2,))
    assert focus <= baseline / 3
