"""Mixture-of-experts models through the decoding step: cached decoding equals the uncached
reference decoder, FOCUS with a huge alpha equals the delayed cache, FOCUS evicts before the
router, and a long run compiles nothing after warm-up; the experts' grouped computation equals a
per-row one, padding rows never computed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focus_jax import GenerationConfig, generate
from focus_jax.compilation import count_compilations
from focus_jax.config import MoEConfig
from focus_jax.engine import Engine, run_to_completion
from focus_jax.model import Model
from focus_jax.models.moe import route, run_experts
from focus_jax.testing import random_prompts, tiny_model
from tests.reference_decoder import reference_decode

THRESHOLD = 0.04
LADDER = (0.25, 1.0)
QWEN3_MOE = MoEConfig(num_experts=8, experts_per_token=2, expert_size=32, dense_layers=(2,))
LLADA2 = MoEConfig(num_experts=16, experts_per_token=4, expert_size=32, dense_layers=(0,),
                   scores="sigmoid", routed_scaling_factor=2.5, num_groups=4, groups_per_token=2,
                   expert_bias=True, shared_expert_size=32)


def llada2_model() -> Model:
    """The LLaDA2-style tiny mixture: groups, expert bias, a shared expert, a dense layer and
    partial rotary."""
    return tiny_model(seed=1, scale=4.0, model_type="llada2_moe", moe=LLADA2,
                      partial_rotary_factor=0.5)


def serves_without_compiling(model: Model) -> dict:
    """Warm an engine of 4 slots of 32 positions up (prefill at six prompt buckets), then serve
    10 random prompts: the results, after checking that serving compiled nothing."""
    config = GenerationConfig(mode="focus", block_size=4, threshold=THRESHOLD, max_new_tokens=12,
                              alpha=1.0, bucket_ladder=LADDER)
    engine = Engine(model, config, slots=4, cache_len=32)
    engine.warmup()
    with count_compilations() as serving:
        for prompt in random_prompts(10, 128, 1, 20, seed=21):
            engine.add_request(prompt)
        results = run_to_completion(engine)
    assert len(results) == 10 and serving.programs == 0
    return results


@pytest.fixture(scope="module", params=["qwen3_moe", "llada2_moe"])
def moe_model(request):
    if request.param == "qwen3_moe":
        return tiny_model(seed=0, scale=4.0, model_type="qwen3_moe", moe=QWEN3_MOE)
    return llada2_model()


def test_cached_baseline_matches_uncached_reference(moe_model):
    block_size = 4
    prompts = random_prompts(4, 128, 2, 3 * block_size - 1, seed=block_size)
    config = GenerationConfig(mode="baseline", block_size=block_size, threshold=THRESHOLD,
                              bucket_ladder=LADDER, max_new_tokens=3 * block_size)
    steps = []
    for prompt, result in zip(prompts, generate(moe_model, prompts, config), strict=True):
        expected, decoded = reference_decode(
            moe_model, prompt, block_size, threshold=THRESHOLD, max_new_tokens=3 * block_size,
            stop_ids=moe_model.stop_token_ids)
        assert result.token_ids == expected
        assert result.stats.decoded_per_step == decoded
        steps += decoded
    assert max(steps) > 1 and min(steps) == 1  # the threshold and the fallback both decided


def test_focus_with_huge_alpha_matches_delayed_and_a_small_alpha_evicts(moe_model):
    prompts = random_prompts(5, 128, 2, 20, seed=11)
    common = dict(block_size=8, threshold=THRESHOLD, max_new_tokens=24, stop_token_ids=(),
                  bucket_ladder=LADDER)
    delayed = generate(moe_model, prompts, GenerationConfig(mode="delayed", **common))
    focus = generate(moe_model, prompts, GenerationConfig(mode="focus", alpha=8.0, **common))
    for a, b in zip(delayed, focus, strict=True):
        assert a.token_ids == b.token_ids
        assert a.stats.processed_per_step == b.stats.processed_per_step
    evicting = generate(moe_model, prompts, GenerationConfig(mode="focus", alpha=1.0, **common))
    processed = sum(sum(r.stats.processed_per_step) for r in evicting)
    retained = sum(sum(r.stats.retained_per_step) for r in evicting)
    assert retained < processed


def test_long_run_compiles_nothing_after_warmup():
    # LLaDA2-style (the Qwen3-MoE fixture's programs differ only in the router).
    serves_without_compiling(llada2_model())


@pytest.mark.parametrize("moe", [QWEN3_MOE, LLADA2])
def test_grouped_experts_equal_a_per_row_computation_and_skip_invalid_rows(moe):
    rng = np.random.default_rng(0)
    n, e, f, x_count = 24, 16, moe.expert_size, moe.num_experts
    x = jnp.asarray(rng.normal(size=(n, e)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(e, x_count)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(x_count,)), jnp.float32) if moe.expert_bias else None
    gate_up = jnp.asarray(rng.normal(size=(x_count, e, 2, f)) / 4, jnp.float32)
    down = jnp.asarray(rng.normal(size=(x_count, f, e)) / 4, jnp.float32)
    valid = jnp.asarray(rng.random(n) < 0.7)
    experts, weights = route(moe, x, router, bias)
    assert len({tuple(r) for r in np.asarray(experts).tolist()}) > 3  # routing varies
    out = np.asarray(jax.jit(run_experts)(x, experts, weights, gate_up, down, valid))
    expected = np.zeros((n, e), np.float32)
    for i in range(n):
        for j in range(moe.experts_per_token):
            g = np.asarray(x[i] @ gate_up[experts[i, j]].reshape(e, 2 * f))
            h = g[:f] / (1 + np.exp(-g[:f])) * g[f:]
            expected[i] += float(weights[i, j]) * (h @ np.asarray(down[experts[i, j]]))
    expected[~np.asarray(valid)] = 0.0
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_the_command_line_names_every_geometry():
    from focus_jax.cli import GEOMETRY_NAMES
    from focus_jax.models import GEOMETRIES, geometry

    assert set(GEOMETRY_NAMES) == set(GEOMETRIES)
    moe = geometry("sdar-30b-a3b")
    assert moe.model_type == "sdar_moe" and moe.layer_kinds == ("sparse",) * 48
    assert 29e9 < moe.num_params < 32e9 and 2.5e9 < moe.active_params < 3.6e9
    mini = geometry("llada2-mini")
    assert mini.layer_kinds[:2] == ("dense", "sparse") and 15e9 < mini.num_params < 17.5e9
