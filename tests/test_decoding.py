"""Cached block-diffusion decoding (modes ``baseline`` and ``delayed``, with and without the
commit refresh) against the uncached reference decoder."""

import jax.numpy as jnp
import numpy as np
import pytest

from focus_jax import GenerationConfig, generate
from focus_jax.compilation import count_compilations
from focus_jax.engine import Engine, SamplingParams, run_to_completion
from focus_jax.models.decoder import forward
from focus_jax.policies import CACHED, MASKED, UNMASKED, DelayedCache, WholeBlock
from focus_jax.testing import random_prompts
from tests.reference_decoder import reference_decode

THRESHOLD = 0.04  # the tiny random model's confidences spread around this value
LADDER = (0.25, 1.0)  # two buckets: compaction exercised, compile time small


def prompts_for(block_size: int) -> list[list[int]]:
    # Different lengths, one a multiple of the block size (its active block starts fresh).
    prompts = random_prompts(4, 128, 2, 3 * block_size - 1, seed=block_size)
    return [*prompts, random_prompts(1, 128, 2 * block_size, 2 * block_size, seed=7)[0]]


@pytest.mark.parametrize(("block_size", "rule"), [
    (4, "low_confidence_dynamic"), (8, "low_confidence_dynamic"),
    (4, "low_confidence_static"), (8, "sequential"),
])
def test_cached_baseline_matches_uncached_reference(model, block_size, rule):
    prompts = prompts_for(block_size)
    config = GenerationConfig(mode="baseline", block_size=block_size, threshold=THRESHOLD,
                              bucket_ladder=LADDER,
                              unmasking=rule, denoising_steps=block_size // 2,
                              max_new_tokens=3 * block_size)
    results = generate(model, prompts, config)
    all_steps = []
    for prompt, result in zip(prompts, results, strict=True):
        expected, steps = reference_decode(
            model, prompt, block_size, threshold=THRESHOLD, max_new_tokens=3 * block_size,
            stop_ids=model.stop_token_ids, rule=rule, denoising_steps=block_size // 2)
        assert result.token_ids == expected
        assert result.stats.decoded_per_step == steps
        all_steps += steps
    if rule == "low_confidence_dynamic":  # both the threshold and the fallback were exercised
        assert max(all_steps) > 1 and min(all_steps) == 1


# The delayed cache's tests share one shape (block 4, 8 slots, 32 positions): one compile.
DELAYED = GenerationConfig(mode="delayed", block_size=4, threshold=THRESHOLD, bucket_ladder=LADDER,
                           max_new_tokens=12, stop_token_ids=())


def delayed_reference(model, prompt, commit_refresh):
    return reference_decode(model, prompt, 4, threshold=THRESHOLD, max_new_tokens=12,
                            mode="delayed", commit_refresh=commit_refresh)


@pytest.mark.parametrize("commit_refresh", [False, True])
def test_cached_delayed_cache_matches_uncached_reference(model, commit_refresh):
    prompts = prompts_for(4)
    results = generate(model, prompts, DELAYED.replace(commit_refresh=commit_refresh))
    for prompt, result in zip(prompts, results, strict=True):
        expected, steps = delayed_reference(model, prompt, commit_refresh)
        assert result.token_ids == expected
        assert result.stats.decoded_per_step == steps


def test_commit_refresh_is_chosen_per_request_and_compiles_nothing_after_warmup(model):
    """Requests with and without the refresh share one batch and one compiled program; each
    decodes what the reference decodes with its own setting, and the setting matters."""
    prompts = prompts_for(4)[:4]
    engine = Engine(model, DELAYED, slots=8, cache_len=32)
    engine.warmup()
    with count_compilations() as serving:
        rids = {(i, refresh): engine.add_request(prompt, SamplingParams(commit_refresh=refresh))
                for i, prompt in enumerate(prompts) for refresh in (True, False)}
        results = run_to_completion(engine)
    assert serving.programs == 0
    for (i, refresh), rid in rids.items():
        assert results[rid].token_ids == delayed_reference(model, prompts[i], refresh)[0]
    assert any(results[rids[i, True]].token_ids != results[rids[i, False]].token_ids
               for i in range(len(prompts)))


def test_commit_refresh_leaves_committed_blocks_with_the_kv_of_an_uncached_forward(model):
    """After a commit with the refresh, every committed position holds the keys and values of
    the uncached block-causal forward over the slot's tokens: what ``baseline``, which rewrites
    its block every step, holds (its cached decoding equals the uncached reference above).
    Without the refresh the delayed cache keeps KV computed while later slots were masks."""
    prompts = random_prompts(8, 128, 2, 7, seed=31)
    engine = Engine(model, DELAYED, slots=8, cache_len=32)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(commit_refresh=i % 2 == 0))
    run_to_completion(engine)
    state = engine.state
    for slot in range(8):
        history, prompt_len = int(state.history[slot]), int(state.prompt_len[slot])
        prefilled = prompt_len // 4 * 4
        assert history >= prefilled + 8  # two blocks committed after the prompt's
        _, kv = forward(model.module(), state.sequence[slot:slot + 1, :history], 4)
        # Per position: the largest difference over layers, heads and features, K and V.
        difference = np.max([np.abs(np.asarray(cached[:, slot, :history]) - np.asarray(want[:, 0]))
                             .max(axis=(0, 2, 3)) for cached, want in zip(
                                 (state.cache.k, state.cache.v), kv, strict=True)], axis=0)
        # Keys and values reach 12 in magnitude; float32 rounding, which differs between the
        # cached and the uncached attention, moves them by up to 1e-4 (baseline's too).
        assert difference[:prefilled].max(initial=0) < 2e-4
        if state.params.commit_refresh[slot]:
            assert difference[prefilled:].max() < 2e-4
        else:  # stale in layers >= 1, by more than 10 here
            assert difference[prefilled:].max() > 1.0


def test_the_delayed_cache_refreshes_a_whole_block_at_its_commit_step_only_when_asked():
    slot_state = jnp.asarray([
        [CACHED, CACHED, UNMASKED, UNMASKED],  # commit step (nothing masked)
        [CACHED, UNMASKED, MASKED, MASKED],    # denoising step
        [CACHED, CACHED, CACHED, UNMASKED],    # commit step, slot not live
    ])
    live = jnp.asarray([True, True, False])
    policy = DelayedCache()
    plain = policy.processed(live, slot_state, jnp.zeros(3, bool))
    refreshed = policy.processed(live, slot_state, jnp.ones(3, bool))
    assert np.asarray(plain).tolist() == [[False, False, True, True], [False, True, True, True],
                                          [False] * 4]
    assert np.asarray(refreshed).tolist() == [[True] * 4, [False, True, True, True], [False] * 4]
    # baseline runs every live slot's whole block, every step: the refresh changes nothing.
    whole = WholeBlock()
    assert (np.asarray(whole.processed(live, slot_state, jnp.zeros(3, bool)))
            == np.asarray(whole.processed(live, slot_state, jnp.ones(3, bool)))).all()


def test_stop_token_ends_the_output_before_it(model):
    prompt = random_prompts(1, 128, 5, 5, seed=3)[0]
    base = GenerationConfig(mode="baseline", block_size=4, threshold=THRESHOLD, bucket_ladder=LADDER,
                            max_new_tokens=16, stop_token_ids=())
    free = generate(model, prompt, base)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    stop = free.token_ids[6]
    first = free.token_ids.index(stop)
    stopped = generate(model, prompt, base.replace(stop_token_ids=(stop,)))[0]
    assert stopped.token_ids == free.token_ids[:first]
    assert stopped.finish_reason == "stop"


def test_max_new_tokens_is_a_hard_cap(model):
    prompt = random_prompts(1, 128, 6, 6, seed=4)[0]
    config = GenerationConfig(mode="baseline", block_size=4, threshold=THRESHOLD, bucket_ladder=LADDER,
                              max_new_tokens=7, stop_token_ids=())
    result = generate(model, prompt, config)[0]
    longer = generate(model, prompt, config.replace(max_new_tokens=12))[0]
    assert len(result.token_ids) == 7 and result.finish_reason == "length"
    assert result.token_ids == longer.token_ids[:7]


def test_sampling_with_top_k_one_is_greedy_and_seeded_sampling_repeats(model):
    prompts = random_prompts(2, 128, 3, 9, seed=5)
    base = GenerationConfig(mode="baseline", block_size=4, threshold=THRESHOLD, bucket_ladder=LADDER,
                            max_new_tokens=8, stop_token_ids=())
    greedy = [r.token_ids for r in generate(model, prompts, base)]
    # At temperature 1 the confidences equal greedy's, and top-k 1 leaves one token to sample.
    top1 = [r.token_ids for r in generate(model, prompts, base.replace(temperature=1.0, top_k=1))]
    assert top1 == greedy
    sampled = base.replace(temperature=1.0, top_p=0.9, seed=1)
    first = [r.token_ids for r in generate(model, prompts, sampled)]
    again = [r.token_ids for r in generate(model, prompts, sampled)]
    other = [r.token_ids for r in generate(model, prompts, sampled.replace(seed=2))]
    assert first == again
    assert first != other and first != greedy


def test_more_prompts_than_slots_are_served_by_refilling_slots(model):
    prompts = prompts_for(4)
    config = GenerationConfig(mode="baseline", block_size=4, threshold=THRESHOLD, bucket_ladder=LADDER,
                              max_new_tokens=8)
    together = [r.token_ids for r in generate(model, prompts, config)]
    two_slots = [r.token_ids for r in generate(model, prompts, config.replace(max_batch=2))]
    assert two_slots == together


@pytest.mark.parametrize(("block", "positions"), [(4, 64), (32, 2048), (8, 40)])
def test_prompt_buckets_pad_by_at_most_half_beyond_two_blocks(block, positions):
    from focus_jax.engine import prompt_buckets

    buckets = prompt_buckets(block, positions)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == positions
    assert all(b % block == 0 for b in buckets)
    for n in range(1, positions + 1):
        padded = next(b for b in buckets if b >= n)
        assert padded < 1.5 * n if n > 2 * block else padded <= 2 * block, (n, padded)


def test_prefill_programs_stop_at_the_chunk_and_cover_every_chunk_of_longer_prompts():
    """Known prompt lengths: whole prefills at the buckets of those up to the chunk; a longer
    prompt runs whole chunks and then its rest, at the rest's bucket. Unknown lengths: every
    bucket up to the chunk, for whole prefills and chunks alike (none of the latter when the
    cache is no longer than a chunk). A chunk must be the block size times a power of two."""
    from focus_jax.config import ConfigError
    from focus_jax.engine.runner import check_prefill_chunk, chunk_rest, prefill_buckets

    assert [chunk_rest(n, 8) for n in (8, 9, 16, 17, 30)] == [8, 1, 8, 1, 6]
    # 30 tokens: chunks of 8, 8, 8, then 6 (bucket 8); 9 and 17: a last chunk of 1 (bucket 4).
    assert prefill_buckets(4, 48, [3, 7, 9, 17, 30], 8) == ((4, 8), (4, 8))
    assert prefill_buckets(4, 48, [3, 30], 16) == ((4,), (16,))  # 30 = 16 + 14 (bucket 16)
    assert prefill_buckets(4, 48, None, 8) == ((4, 8), (4, 8))
    assert prefill_buckets(4, 8, None, 8) == ((4, 8), ())
    for chunk in (6, 12, 2):
        with pytest.raises(ConfigError, match=r"block size \(4\) times a power of two"):
            check_prefill_chunk(4, chunk)


def test_prefill_batches_prompts_of_similar_length_and_keeps_each_result(model):
    """Requests admitted together are prefilled shortest first, each batch padded to the
    bucket (``engine.prompt_buckets``) over its own longest prompt; results still belong to their
    requests."""
    from focus_jax.engine import Engine, run_to_completion

    config = GenerationConfig(mode="baseline", block_size=4, threshold=THRESHOLD,
                              bucket_ladder=LADDER, max_new_tokens=4)
    engine = Engine(model, config, slots=4, cache_len=64, prefill_batch=2)
    calls = []
    run_prefill = engine.runner._run_prefill

    def record(tokens, lengths, slots, params):
        calls.append((tokens.shape[1], sorted(lengths[slots < engine.slots].tolist())))
        run_prefill(tokens, lengths, slots, params)

    engine.runner._run_prefill = record
    prompts = [random_prompts(1, 128, n, n, seed=n)[0] for n in (30, 3, 29, 2)]
    ids = [engine.add_request(p) for p in prompts]
    results = run_to_completion(engine)
    assert calls == [(4, [2, 3]), (32, [29, 30])]
    via_generate = [r.token_ids for r in generate(model, prompts, config)]
    assert [results[i].token_ids for i in ids] == via_generate
    assert [results[i].prompt_tokens for i in ids] == [30, 3, 29, 2]


def test_a_request_admitted_alone_is_prefilled_alone_and_compiles_nothing(model):
    """Up to half a prefill batch is prefilled a request at a time (one row, not a batch of
    padding rows); warm-up compiles those programs too, and the tokens are unchanged."""
    from focus_jax.compilation import count_compilations
    from focus_jax.engine import Engine, run_to_completion

    config = GenerationConfig(mode="focus", block_size=4, threshold=THRESHOLD,
                              bucket_ladder=LADDER, max_new_tokens=16, steps_per_round=4)
    engine = Engine(model, config, slots=4, cache_len=64, prefill_batch=4)
    engine.warmup()
    rows = []
    run_prefill = engine.runner._run_prefill

    def record(tokens, lengths, slots, params):
        rows.append((tokens.shape[0], int((slots < engine.slots).sum())))
        run_prefill(tokens, lengths, slots, params)

    engine.runner._run_prefill = record
    prompts = [random_prompts(1, 128, n, n, seed=n)[0] for n in (5, 9, 7, 3, 6)]
    with count_compilations() as compiled:
        first = engine.add_request(prompts[0])
        engine.step()  # admitted alone, into an idle engine; still running after the round
        rest = [engine.add_request(p) for p in prompts[1:]]  # three fit now, one waits
        results = run_to_completion(engine)
    assert compiled.programs == 0
    assert rows == [(1, 1), (4, 3), (1, 1)]
    via_generate = [r.token_ids for r in generate(model, prompts, config)]
    assert [results[i].token_ids for i in [first, *rest]] == via_generate


@pytest.mark.parametrize("steps", [2, 5])  # a window of 8 positions of 16; the whole cache
def test_a_rounds_packed_results_unpack_to_its_step_counts_slot_progress_and_window(steps):
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from focus_jax import decoding
    from focus_jax.testing import tiny_config

    slots, block, positions = 3, 4, 16
    rng = np.random.default_rng(0)
    state = decoding.init_state(tiny_config(), slots, positions, block, mask_token_id=1)
    sequence = rng.integers(0, 128, (slots, positions))
    state = dataclasses.replace(
        state, live=jnp.asarray([True, False, True]), out_len=jnp.asarray([0, 7, 2]),
        history=jnp.asarray([8, 12, 4]), sequence=jnp.asarray(sequence))
    flags = [rng.random((steps, slots, block)) < 0.5 for _ in range(4)]
    step_live = rng.random((steps, slots)) < 0.5
    buckets = rng.integers(0, 13, (2, steps))
    logs = decoding.StepLog(*map(jnp.asarray, flags), live=jnp.asarray(step_live),
                            processed_bucket=jnp.asarray(buckets[0]),
                            retained_bucket=jnp.asarray(buckets[1]))
    start = np.asarray([4, 8, 12])  # the window runs past the cache in slot 2 when it is wide
    packed = np.asarray(decoding.pack_round(state, logs, jnp.int32(4), jnp.asarray(start)))
    got = decoding.unpack_round(packed, steps)
    assert got.steps == 4
    for name, flag in zip(("processed", "retained", "decoded", "sampled"), flags, strict=True):
        np.testing.assert_array_equal(getattr(got, name), flag.sum(-1), name)
    np.testing.assert_array_equal(got.step_live, step_live)
    np.testing.assert_array_equal(got.processed_bucket, buckets[0])
    np.testing.assert_array_equal(got.retained_bucket, buckets[1])
    np.testing.assert_array_equal(got.live, [True, False, True])
    np.testing.assert_array_equal(got.out_len, [0, 7, 2])
    np.testing.assert_array_equal(got.history, [8, 12, 4])
    width = decoding.window_width(steps, block, positions)
    assert got.window.shape == (slots, width) == (slots, min(steps * block, positions))
    for slot in range(slots):
        inside = min(width, positions - start[slot])
        np.testing.assert_array_equal(got.window[slot, :inside],
                                      sequence[slot, start[slot]:start[slot] + inside])
    # Tokens from the known ones and the window; positions the window lacks are an error.
    prompt_len, known = 6, sequence[0, 6:8].tolist()  # slot 0 returned its first two
    end = min(4 + width, positions)  # the window's end, or the cache's
    assert got.tokens(0, known, prompt_len, end) == sequence[0, 6:end].tolist()
    assert got.tokens(0, [], prompt_len, 8) == sequence[0, 6:8].tolist()
    assert got.tokens(0, known, prompt_len, 7) == known[:1]
    with pytest.raises(RuntimeError, match="outside the round's window"):
        got.tokens(0, known, prompt_len, 4 + width + 1)
    with pytest.raises(RuntimeError, match="outside the round's window"):
        got.tokens(1, [], 2, 10)  # position 2 comes before slot 1's window (from 8)
