"""The request lifecycle: add_request / abort / step, per-request parameters, AsyncEngine."""

import asyncio
import contextlib
import time

import jax
import pytest

from focus_jax import GenerationConfig
from focus_jax.compilation import count_compilations
from focus_jax.engine import AsyncEngine, Engine, QueueFull, RequestError, SamplingParams, run_to_completion
from focus_jax.testing import optimising_cpu_compiles, random_prompts

THRESHOLD = 0.04
CONFIG = GenerationConfig(mode="focus", block_size=4, threshold=THRESHOLD, alpha=1.0,
                          max_new_tokens=12, stop_token_ids=(), bucket_ladder=(0.25, 1.0),
                          steps_per_round=4)

# Requests that differ in every per-request parameter.
MIXED = [
    SamplingParams(),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(threshold=0.2, alpha=2.5, max_new_tokens=5),
    SamplingParams(temperature=0.7, top_k=5, seed=11, max_new_tokens=9),
    SamplingParams(stop_token_ids=(7, 9, 11)),
    SamplingParams(temperature=1.3, seed=5, threshold=0.5),
]


SLOTS = 2
"""The slots of the engines that run a request alone or a few as a reference: one engine shape
(one compiled round) for all of them (a request's tokens do not depend on its batch here)."""


def alone(model, prompt, params):
    engine = Engine(model, CONFIG, slots=SLOTS, cache_len=64)
    rid = engine.add_request(prompt, params)
    return run_to_completion(engine)[rid]


def test_mixed_parameters_compile_nothing_and_match_each_request_alone(model):
    prompts = random_prompts(len(MIXED), 128, 2, 14, seed=41)
    engine = Engine(model, CONFIG, slots=4, cache_len=64)
    engine.warmup()
    with count_compilations() as serving:
        rids = [engine.add_request(p, q) for p, q in zip(prompts, MIXED, strict=True)]
        together = run_to_completion(engine)
    assert serving.programs == 0
    outputs = [together[rid] for rid in rids]
    for prompt, params, result in zip(prompts, MIXED, outputs, strict=True):
        assert result.token_ids == alone(model, prompt, params).token_ids
    # The parameters took effect: the capped requests stopped at their cap, sampling changed
    # the tokens, and a stop id ends its output before the stop token.
    assert len(outputs[2].token_ids) == 5 and len(outputs[3].token_ids) <= 9
    greedy = alone(model, prompts[1], SamplingParams())
    assert outputs[1].token_ids != greedy.token_ids
    assert not {7, 9, 11} & set(outputs[4].token_ids)


def test_a_sampled_request_gives_the_same_tokens_in_any_slot_and_batch(model):
    prompt = random_prompts(1, 128, 6, 6, seed=42)[0]
    params = SamplingParams(temperature=1.0, seed=7)
    first = alone(model, prompt, params).token_ids
    engine = Engine(model, CONFIG, slots=4, cache_len=64)
    others = random_prompts(3, 128, 2, 14, seed=43)
    ids = [engine.add_request(p, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(others)]
    rid = engine.add_request(prompt, params)  # the last slot, beside three sampled neighbours
    results = run_to_completion(engine)
    assert results[rid].token_ids == first
    assert alone(model, prompt, SamplingParams(temperature=1.0, seed=8)).token_ids != first
    assert len({tuple(results[i].token_ids) for i in ids}) == 3


def test_abort_frees_the_slot_for_the_next_waiting_request(model):
    prompts = random_prompts(3, 128, 2, 10, seed=44)
    engine = Engine(model, CONFIG.replace(max_new_tokens=40), slots=2, cache_len=64)
    first, second, waiting = (engine.add_request(p) for p in prompts)
    outputs = engine.step()  # first and second run; the third waits
    assert engine.num_running == 2 and engine.num_waiting == 1
    slot = next(s for s, r in engine.scheduler.running.items() if r.rid == first)
    engine.abort(first)
    outputs = engine.step()
    ended = [o for o in outputs if o.request_id == first]
    assert len(ended) == 1 and ended[0].finished and ended[0].finish_reason == "abort"
    assert engine.scheduler.running[slot].rid == waiting  # the freed slot took the waiting one
    results = run_to_completion(engine)
    assert set(results) == {second, waiting}
    assert results[waiting].token_ids == alone(model, prompts[2],
                                               SamplingParams(max_new_tokens=40)).token_ids


def test_aborting_a_waiting_request_ends_it_at_the_next_step(model):
    engine = Engine(model, CONFIG, slots=SLOTS, cache_len=64)
    *running, waiting = (engine.add_request(p) for p in random_prompts(3, 128, 2, 8, seed=45))
    engine.abort(waiting)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [(waiting, "abort")]
    assert set(run_to_completion(engine)) == set(running)


def test_a_request_that_no_longer_fits_when_admitted_ends_with_an_error(model):
    engine = Engine(model, CONFIG, slots=2, cache_len=64)
    prompts = random_prompts(3, 128, 4, 12, seed=46)
    good = [engine.add_request(p) for p in prompts[:2]]
    bad = engine.add_request(prompts[2], SamplingParams(max_new_tokens=40))
    engine.scheduler.cache_len = 32  # as if the cache shrank while it waited
    results = run_to_completion(engine)
    assert results[bad].finish_reason == "error" and "cache" in results[bad].error
    assert all(results[r].finish_reason in ("stop", "length") for r in good)


def test_a_failing_request_ends_with_an_error_and_the_others_finish(model):
    config = CONFIG.replace(max_new_tokens=16)
    prompts = random_prompts(4, 128, 2, 10, seed=47)
    first = Engine(model, config, slots=4, cache_len=64, detokenize=False)
    ids = [first.add_request(p) for p in prompts]
    done = run_to_completion(first)
    plain = [done[r].token_ids for r in ids]
    # A token some outputs hold and others do not: decoding it fails.
    bad = next(t for t in sorted(set().union(*plain)) if not all(t in ids for ids in plain))

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            if bad in ids:
                raise ValueError(f"cannot decode token {bad}")
            return " ".join(map(str, ids))

    engine = Engine(model, config, slots=4, cache_len=64)
    engine.output.tokenizer = Tokenizer()
    rids = [engine.add_request(p) for p in prompts]
    results = run_to_completion(engine)
    errors = [r for r, ids in zip(rids, plain, strict=True) if bad in ids]
    assert [r for r in rids if results[r].finish_reason == "error"] == errors
    assert all(f"token {bad}" in results[r].error for r in errors)
    assert all(results[r].finish_reason in ("stop", "length") for r in rids if r not in errors)


def test_bad_requests_are_refused_with_a_message(model):
    engine = Engine(model, CONFIG, slots=1, cache_len=32)
    with pytest.raises(RequestError, match="cache"):
        engine.add_request([5] * 10, SamplingParams(max_new_tokens=30))
    with pytest.raises(TypeError, match="integers"):
        engine.add_request([1.5, 2])
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(RequestError, match="stop token ids"):
        SamplingParams(stop_token_ids=tuple(range(9)))
    with pytest.raises(RequestError, match="commit_refresh must be true or false, got 'yes'"):
        SamplingParams(commit_refresh="yes")


# ------------------------------------------------------------------------------- AsyncEngine
@pytest.fixture(scope="module")
def bundled_model():
    from focus_jax.cli import load_model

    return load_model(None)


@pytest.fixture
def bundled(bundled_model):
    """The bundled model, its engines' programs compiled with XLA's optimising CPU backend:
    these tests run the round for many more tokens than it takes to compile."""
    with optimising_cpu_compiles():
        yield bundled_model


def bundled_engine(model, **changes):
    """The server's kind of engine (its round checks for arrivals), one shape for every test
    of the bundled model here: one compiled round."""
    config = GenerationConfig(mode="focus", max_new_tokens=32, bucket_ladder=(0.25, 1.0),
                              steps_per_round=8, interruptible_rounds=True).replace(**changes)
    return Engine(model, config, slots=8, cache_len=128)


def test_async_engine_serves_32_concurrent_consumers_each_its_own_output(bundled):
    from focus_jax.api import encode_prompt

    questions = [f"Add: {100 + 7 * i}+{200 + 3 * i}" for i in range(32)]
    prompts = [encode_prompt(bundled, q) for q in questions]
    # The server's engine (its round checks for arrivals), run to completion without arrivals:
    # the same program as below, compiled once.
    expected_engine = bundled_engine(bundled)
    rids = [expected_engine.add_request(p) for p in prompts]
    expected = run_to_completion(expected_engine)

    async def consume(engine, prompt):
        outputs = [out async for out in engine.generate(prompt)]
        assert all(not o.finished for o in outputs[:-1]) and outputs[-1].finished
        ids = [t for o in outputs for t in o.new_token_ids]
        assert ids == outputs[-1].token_ids
        return outputs[-1]

    async def main():
        # As the server runs it: arrivals for free slots interrupt the running round.
        engine = AsyncEngine(bundled_engine(bundled))
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(consume(engine, p) for p in prompts)), timeout=300)
        finally:
            await engine.shutdown(grace_seconds=5)

    finals = asyncio.run(main())
    for rid, final in zip(rids, finals, strict=True):
        assert final.token_ids == expected[rid].token_ids
        assert final.text == expected[rid].text


def test_arrivals_interrupt_the_round_only_while_a_slot_is_free(model):
    """The server's engine ends the running round for an arrival that a free slot can take, not
    for one that must wait anyway; the outputs are those of an engine without interrupts."""
    prompts = random_prompts(3, 128, 6, 6, seed=24)
    # The interrupt test's round below (8 steps): one program for both.
    config = CONFIG.replace(max_new_tokens=8, steps_per_round=8)
    expected = run_to_completion_of(model, config, prompts)

    class Recording(AsyncEngine):
        submitted_at_interrupts: list[int]

        def _interrupt_round(self):
            self.submitted_at_interrupts.append(self._submitted)
            super()._interrupt_round()

    async def main():
        engine = Recording(Engine(model, config.replace(interruptible_rounds=True), slots=2,
                                  cache_len=64))
        engine.submitted_at_interrupts = []

        async def consume(prompt):
            return [out async for out in engine.generate(prompt)][-1].token_ids

        try:
            outputs = await asyncio.wait_for(asyncio.gather(*(consume(p) for p in prompts)),
                                             timeout=300)
            return outputs, list(engine.submitted_at_interrupts)
        finally:
            await engine.shutdown(grace_seconds=5)

    outputs, interrupts = asyncio.run(main())
    assert outputs == expected
    assert interrupts == [1, 2]  # the third arrival found both slots taken


def test_a_consumer_that_stops_early_frees_its_slot_and_disturbs_no_other(bundled):
    from focus_jax.api import encode_prompt

    prompts = [encode_prompt(bundled, q) for q in ("Reverse: a b c d", "Add: 12+34")]
    reference = bundled_engine(bundled)
    rid = reference.add_request(prompts[1])
    expected = run_to_completion(reference)[rid]

    async def main():
        engine = AsyncEngine(bundled_engine(bundled, max_new_tokens=96))
        try:
            async def stop_after_first_block():
                async with contextlib.aclosing(engine.generate(prompts[0])) as stream:
                    async for _ in stream:
                        break

            async def full():
                return [o async for o in engine.generate(prompts[1],
                                                         SamplingParams(max_new_tokens=32))][-1]

            _, other = await asyncio.wait_for(asyncio.gather(stop_after_first_block(), full()),
                                              timeout=120)
            deadline = time.monotonic() + 30
            while engine.num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return other, engine.num_running
        finally:
            await engine.shutdown(grace_seconds=5)

    other, running = asyncio.run(main())
    assert other.token_ids == expected.token_ids
    assert running == 0


def test_shutdown_with_requests_in_flight_returns_and_ends_every_request(bundled):
    from focus_jax.api import encode_prompt

    prompt = encode_prompt(bundled, "Reverse: p a l l a s")

    async def main():
        # No stop token: a short answer could end a running request between the checks below, and
        # with it the wait for a slot that makes the eleventh request QueueFull.
        engine = AsyncEngine(bundled_engine(bundled, max_new_tokens=96, stop_token_ids=()),
                             max_queue=2)
        finals = []

        async def consume():
            async for out in engine.generate(prompt):
                if out.finished:
                    finals.append(out.finish_reason)

        async def until(condition):
            deadline = time.monotonic() + 60
            while not condition() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(consume()) for _ in range(8)]  # every slot
        await until(lambda: engine.num_running == 8)
        tasks += [asyncio.create_task(consume()) for _ in range(2)]  # these two wait
        await until(lambda: engine.num_waiting == 2)
        with pytest.raises(QueueFull):
            async for _ in engine.generate(prompt):
                pass
        start = time.monotonic()
        await engine.shutdown(grace_seconds=0.0)
        took = time.monotonic() - start
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        return finals, took, engine.running

    finals, took, alive = asyncio.run(main())
    assert len(finals) == 10 and set(finals) <= {"abort", "stop", "length"} and "abort" in finals
    assert took < 30 and not alive


def test_max_queue_counts_waiting_requests_not_running_ones(model):
    """4 slots and max_queue=2: of a burst of 10 requests, 4 run, 2 wait, 4 are refused."""
    config = GenerationConfig(mode="focus", block_size=4, max_new_tokens=8, bucket_ladder=(1.0,))

    async def burst() -> tuple[int, int]:
        engine = AsyncEngine(Engine(model, config, slots=4, cache_len=32), max_queue=2)

        async def one() -> str:
            try:
                async for out in engine.generate([5, 6, 7]):
                    if out.finished:
                        return "done"
            except QueueFull:
                return "full"
            return "unfinished"

        outcomes = await asyncio.gather(*(one() for _ in range(10)))
        await engine.shutdown()
        return outcomes.count("done"), outcomes.count("full")

    assert asyncio.run(burst()) == (6, 4)


def test_open_loop_bench_serves_every_request_and_orders_its_latencies(model):
    from focus_jax import bench

    result = bench.run_open_loop(model, "focus", batch=2, requests=5, max_new_tokens=8,
                                 request_rate=50.0, block_size=4, bucket_ladder=(0.5, 1.0))
    assert result.requests == 5 and result.generated_tokens == 5 * 8 and result.compilations == 0
    for q in ("p50", "p90", "p99"):
        assert 0 <= result.admission_wait[q] <= result.first_block[q] <= result.latency[q]


def test_rounds_are_short_while_a_slot_is_free_and_whole_when_every_slot_is_busy(model):
    """A free slot (nothing waiting) ends rounds after ``free_slot_round_steps``, so an arrival is
    admitted soon; with every slot busy rounds run ``steps_per_round``. The same compiled round
    runs both, and the tokens do not depend on where rounds end."""
    config = CONFIG.replace(steps_per_round=8, free_slot_round_steps=2, max_new_tokens=24)
    prompts = random_prompts(2, 128, 6, 6, seed=21)
    engine = Engine(model, config, slots=2, cache_len=64)
    engine.warmup()

    def steps_of_one_round() -> int:
        before = engine.stats.steps
        engine.step()
        return engine.stats.steps - before

    with count_compilations() as compiled:
        first = engine.add_request(prompts[0])
        # Until its first output (a short round also ends there: the next test).
        for _ in range(8):
            if any(out.new_token_ids for out in engine.step()):
                break
        alone_rounds = [steps_of_one_round() for _ in range(3)]
        second = engine.add_request(prompts[1])
        full_rounds = [steps_of_one_round() for _ in range(2)]
        results = run_to_completion(engine)
    assert compiled.programs == 0
    assert alone_rounds == [2, 2, 2] and full_rounds == [8, 8]
    reference = run_to_completion_of(model, CONFIG.replace(max_new_tokens=24), prompts)
    assert [results[first].token_ids, results[second].token_ids] == reference


def test_a_short_round_ends_as_soon_as_a_request_has_its_first_output(model):
    """While a slot is free a round stops at the step that commits a request's first output
    block, which is streamed at once; later rounds run their length. Where the first output
    comes is found by an engine that runs one step per round (rounds that never stop early)."""
    config = CONFIG.replace(steps_per_round=8, free_slot_round_steps=8, max_new_tokens=24)
    prompt = random_prompts(1, 128, 6, 6, seed=22)[0]

    # One step per round while a slot is free (always here: one request in two slots), on the
    # same compiled round.
    one_step_rounds = Engine(model, config.replace(free_slot_round_steps=1), slots=2,
                             cache_len=64)
    one_step_rounds.add_request(prompt)
    steps_to_first_output = 0
    while True:
        steps_to_first_output += 1
        if any(out.new_token_ids for out in one_step_rounds.step()):
            break
    assert steps_to_first_output < 8  # else a round of 8 could not end early

    engine = Engine(model, config, slots=2, cache_len=64)
    rid = engine.add_request(prompt)
    first_round = engine.step()
    assert engine.stats.steps == steps_to_first_output
    assert [out.request_id for out in first_round if out.new_token_ids] == [rid]
    engine.step()
    assert engine.stats.steps == steps_to_first_output + 8
    results = run_to_completion(engine)
    assert results[rid].token_ids == run_to_completion_of(model, CONFIG.replace(max_new_tokens=24),
                                                          [prompt])[0]


def test_a_set_interrupt_ends_the_round_after_one_step_and_changes_no_token(model):
    """With interruptible rounds, a round that finds its interrupt set runs one step (never
    none); cleared, rounds run their length again. The same compiled round serves both, and the
    tokens do not depend on where rounds end."""
    config = CONFIG.replace(steps_per_round=8, free_slot_round_steps=8, max_new_tokens=24,
                            interruptible_rounds=True)
    prompts = random_prompts(2, 128, 6, 6, seed=23)
    engine = Engine(model, config, slots=2, cache_len=64)
    engine.warmup()
    interrupt = engine.round_interrupt
    with count_compilations() as compiled:
        rids = [engine.add_request(p) for p in prompts]
        interrupt.set()
        rounds = []
        for _ in range(3):
            before = engine.stats.steps
            engine.step()
            rounds.append(engine.stats.steps - before)
        interrupt.clear()
        before = engine.stats.steps
        engine.step()
        whole = engine.stats.steps - before
        results = run_to_completion(engine)
    assert compiled.programs == 0
    assert rounds == [1, 1, 1] and whole == 8  # both slots busy: whole rounds
    reference = run_to_completion_of(model, CONFIG.replace(max_new_tokens=24), prompts)
    assert [results[rid].token_ids for rid in rids] == reference


def test_rounds_without_interrupts_have_none_and_interrupts_are_released():
    import gc

    from focus_jax import interrupts

    interrupt = interrupts.Interrupt()
    channel = interrupt.channel
    assert channel != interrupts.NO_CHANNEL and channel in interrupts._FLAGS
    interrupt.set()
    assert bool(interrupts._is_set(channel)) and not bool(interrupts._is_set(interrupts.NO_CHANNEL))
    del interrupt
    gc.collect()
    assert channel not in interrupts._FLAGS and not bool(interrupts._is_set(channel))


def run_to_completion_of(model, config, prompts):
    engine = Engine(model, config, slots=SLOTS, cache_len=64)
    ids = [engine.add_request(p) for p in prompts]
    results = run_to_completion(engine)
    return [results[i].token_ids for i in ids]


def test_an_engine_without_a_size_takes_the_platforms_or_the_configs(model):
    config = GenerationConfig(mode="focus", block_size=4)
    assert jax.default_backend() == "cpu"  # the tests' platform (conftest)
    engine = Engine(model, config)
    assert (engine.slots, engine.cache_len) == (4, 256)
    sized = Engine(model, config.replace(max_batch=2, max_cache_len=64))
    assert (sized.slots, sized.cache_len) == (2, 64)
