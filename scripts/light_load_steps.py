"""Where a lightly loaded engine's step time goes: device rounds alone against whole engine steps.

    python scripts/light_load_steps.py --geometry sdar-8b --batch 256 --requests 8

A few requests in many slots (a server below saturation). After a warm-up, it times:

- ``device``: decode rounds of 1, 4 and ``--round-steps`` steps called back to back, the state
  kept on the device (only the step count read back, after each round or, ``unsynced``, at the
  end), and single steps as programs of their own (no ``while_loop``, so no loop condition read
  back per step): the device's step time, launches and syncs included; and a program that
  computes nothing, for the cost of a call alone;
- ``engine``: ``Engine.step`` rounds of 4 steps and of ``steps_per_round`` steps (what the engine
  runs while a slot is free and nothing waits, and otherwise): the device time plus the copy of
  each round's results and the host's work on them.

Writes one JSON object (``--json``) with ms per step for each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from focus_jax import bench, compilation, decoding
from focus_jax.engine import run_to_completion

STEPS = 48
"""Steps (or program calls) per repetition of a device variant."""
REPEATS = 3
"""Repetitions of each device variant; the median is reported."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_light_load_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--mode", default="focus")
    parser.add_argument("--ladder", default=None, help="bucket ladder fractions, comma-separated")
    parser.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                        help="set or override one of compilation.GPU_COMPILER_OPTIONS (repeat)")
    parser.add_argument("--round-steps", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    for option in args.compiler_option:
        key, sep, value = option.partition("=")
        if not sep:
            parser.error(f"--compiler-option wants KEY=VALUE, got {option!r}")
        compilation.GPU_COMPILER_OPTIONS[key] = {"true": True, "false": False}.get(value, value)
    ladder = tuple(float(f) for f in args.ladder.split(",")) if args.ladder else None
    engine, prompts = bench.light_load(args.geometry, args.batch, args.requests, args.cache_len,
                                       mode=args.mode, max_new_tokens=args.max_new_tokens,
                                       kernels=args.kernels, bucket_ladder=ladder)
    config = engine.config
    result = {"geometry": args.geometry, "batch": args.batch, "requests": args.requests,
              "mode": args.mode, "kernels": args.kernels, "ladder": ladder,
              "compiler_options": dict(compilation.GPU_COMPILER_OPTIONS),
              "device": jax.devices()[0].device_kind}

    # Device rounds alone: the requests admitted and prefilled, then rounds back to back (long
    # requests, started afresh before each group of variants: none finishes during one).
    running: list[int] = []

    def restart_requests() -> None:
        for rid in running:
            engine.abort(rid)
        run_to_completion(engine)
        running[:] = bench.start_long_requests(engine, prompts)

    restart_requests()
    runner = engine.runner
    program = runner._round_program()

    def timed(label: str, call, count: int, sync_each: bool) -> None:
        """``call()`` ``count`` times (it returns the steps it ran, as a device scalar), in
        ``REPEATS`` repetitions; the median ms per step, reading the step count back after each
        call or only at the end."""
        per_step = []
        for _ in range(REPEATS):
            jax.block_until_ready(runner.state)
            ran, start = [], time.perf_counter()
            for _ in range(count):
                ran.append(call())
                if sync_each:
                    ran[-1] = int(ran[-1])
            steps = sum(int(r) for r in ran)
            if steps < count:
                raise SystemExit(f"{label}: {steps} steps in {count} calls (a request ended)")
            per_step.append(1e3 * (time.perf_counter() - start) / steps)
        result[label] = statistics.median(per_step)
        print(f"{label}: {result[label]:.2f} (of {', '.join(f'{t:.2f}' for t in per_step)})",
              flush=True)

    def round_of(steps: int):
        def call():
            runner.state, _, ran = program(*runner._round_args(False, steps))
            return ran
        return call

    for steps, sync in ((1, True), (4, True), (4, False), (args.round_steps, True)):
        timed(f"device_rounds_of_{steps}{'' if sync else '_unsynced'}_ms_per_step",
              round_of(steps), STEPS // steps, sync)
    graphdef, settings = runner.model.graphdef, runner.settings
    options = compilation.GPU_COMPILER_OPTIONS
    # The cost of a program call alone: the round's arguments in, the state donated and given
    # back unchanged, nothing computed.
    trivial = jax.jit(lambda params, state: (dataclasses.replace(state, live=~(~state.live)),
                                             jnp.ones((), jnp.int32)),
                      donate_argnums=(1,), compiler_options=options)

    def trivial_call():
        runner.state, one = trivial(runner.model.params, runner.state)
        return one

    trivial_call()
    timed("device_trivial_program_ms_per_call", trivial_call, STEPS, True)
    # One step per program call, no while loop: no condition read back per step.
    one_step = jax.jit(lambda params, state: decoding.step(nnx.merge(graphdef, params), state,
                                                           settings)[0],
                       donate_argnums=(1,), compiler_options=options)

    def step_call():
        runner.state = one_step(runner.model.params, runner.state)
        return 1

    restart_requests()
    step_call()  # compiles
    timed("device_single_step_programs_ms_per_step", step_call, STEPS, False)
    # The same rounds, each followed by the engine's copy of its results to the host.
    steps, start = 0, time.perf_counter()
    for _ in range(6):
        steps += runner.decode_round(False, args.round_steps).steps
    result["device_and_copy_ms_per_step"] = 1e3 * (time.perf_counter() - start) / steps
    for rid in running:
        engine.abort(rid)
    run_to_completion(engine)

    for round_steps in sorted({config.free_slot_round_steps, config.steps_per_round}):
        engine.config = config.replace(free_slot_round_steps=round_steps)
        for prompt in prompts:
            engine.add_request(prompt)
        engine.step()  # admission and prefill out of the timing
        before = {k: getattr(engine.stats, k) for k in
                  ("steps", "rounds", "decode_seconds", "host_seconds", "wall_seconds")}
        run_to_completion(engine)
        after = {k: getattr(engine.stats, k) - v for k, v in before.items()}
        per = 1e3 / after["steps"]
        result[f"engine_rounds_of_{round_steps}"] = {
            "steps": after["steps"], "rounds": after["rounds"],
            "wall_ms_per_step": after["wall_seconds"] * per,
            "decode_ms_per_step": after["decode_seconds"] * per,
            "host_ms_per_step": after["host_seconds"] * per}
    # Steps per compaction bucket (rows) over the whole run: the attention's row counts.
    for field in ("processed_buckets", "retained_buckets"):
        result[field] = dict(sorted(getattr(engine.stats, field).items()))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if engine.has_unfinished():
        raise SystemExit("requests were left unfinished")


if __name__ == "__main__":
    main()
