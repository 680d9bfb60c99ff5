"""Where the device time of decode rounds goes: a profiler trace, summed per HLO op.

    python scripts/profile_round.py --geometry sdar-8b --batch 256 --modes baseline,focus --out prof

Serves ``--batch`` random prompts once to warm up, then again under ``jax.profiler.trace``. The
trace's device kernels are summed per HLO op (a fusion, a GEMM, a custom call) and printed with
the JAX source that made each op (from the compiled round's metadata); ``--out`` gets the raw
trace and a JSON summary per mode.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import tempfile
import time
from pathlib import Path

import jax
from jax._src.profiler import ProfileData

import focus_jax
from focus_jax import bench
from focus_jax.config import GenerationConfig
from focus_jax.engine import Engine, run_to_completion

METADATA = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}")
OP_NAME = re.compile(r'op_name="([^"]*)"')
SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')


def op_sources(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the JAX op name (and source line, where the HLO text has one)
    recorded in its metadata."""
    sources = {}
    for line in hlo_text.splitlines():
        match = METADATA.match(line)
        if not match:
            continue
        name, meta = match.groups()
        op = OP_NAME.search(meta)
        src = SOURCE.search(meta)
        where = f"{Path(src.group(1)).name}:{src.group(2)}" if src else ""
        # The op name's last parts: the transformations and primitive that made the op.
        sources[name] = f"{'/'.join(op.group(1).split('/')[-3:]) if op else ''} {where}".strip()
    return sources


def device_time_per_op(trace_dir: str) -> tuple[dict[str, list[float]], float]:
    """Sum of kernel time (ms) and launch count per HLO op on the device planes, and the span
    from the first kernel start to the last kernel end (ms)."""
    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    first, last = float("inf"), 0.0
    planes = list(ProfileData.from_file(files[0]).planes)
    on_device = any(p.name.startswith("/device:") for p in planes)
    for plane in planes:
        if not plane.name.startswith("/device:" if on_device else "/host:CPU"):
            continue
        for line in plane.lines:
            # GPU kernels sit on "Stream #..." lines; the CPU backend runs ops on XLA threads.
            if not line.name.startswith("Stream" if on_device else "tf_XLA"):
                continue
            for event in line.events:
                stats = dict(event.stats)
                if not on_device and "hlo_op" not in stats:
                    continue
                key = str(stats.get("hlo_op", event.name))
                module = str(stats.get("hlo_module", ""))
                if module and "_round" not in module:  # prefill and others: name the program
                    key = f"{module}:{key}"
                totals[key][0] += event.duration_ns / 1e6
                totals[key][1] += 1
                first = min(first, event.start_ns)
                last = max(last, event.start_ns + event.duration_ns)
    return dict(totals), (last - first) / 1e6 if totals else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="sdar-8b", help="random weights of this geometry")
    parser.add_argument("--model", help="a checkpoint folder instead of --geometry")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests served (default --batch): fewer than slots profiles a "
                             "lightly loaded engine")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--modes", default="baseline,focus")
    parser.add_argument("--ladder", help="bucket ladder fractions, comma-separated")
    parser.add_argument("--kernels", default=None, help="GenerationConfig.kernels")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default="profile")
    args = parser.parse_args()

    # The round is compiled twice (to run, then for its HLO text): the second is a cache hit.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
    model = focus_jax.load(args.model) if args.model else bench.random_model(args.geometry)
    name = args.model or args.geometry
    lengths = bench.prompt_lengths(args.requests or args.batch)
    prompts = bench.random_prompts(model.config, lengths, seed=1)  # as bench.run's (seed 0)
    extra = {"bucket_ladder": tuple(float(f) for f in args.ladder.split(","))} if args.ladder else {}
    if args.kernels:
        extra["kernels"] = args.kernels
    out = Path(args.out)
    cache_len = max(lengths) + args.max_new_tokens
    configs = {mode: GenerationConfig(mode=mode, block_size=model.config.block_size or 32,
                                      max_new_tokens=args.max_new_tokens, stop_token_ids=(),
                                      **extra)
               for mode in args.modes.split(",")}
    # Every mode's programs are compiled first, for the weights' shapes, before any engine
    # holds its cache: at SDAR-30B-A3B on the H200 the weights and one engine's cache leave too
    # little memory for XLA's GEMM autotuning (seen: out of memory while compiling).
    bench.compile_engines(model, [(config, args.batch, cache_len, lengths)
                                  for config in configs.values()])
    for mode, config in configs.items():
        engine = Engine(model, config, slots=args.batch, cache_len=cache_len)
        engine.warmup(prompt_lengths=lengths)
        for prompt in prompts:  # a first, untraced pass
            engine.add_request(prompt)
        run_to_completion(engine)
        for prompt in prompts:
            engine.add_request(prompt)
        steps_before, start = engine.stats.steps, time.perf_counter()
        trace_dir = str(out / mode)
        with jax.profiler.trace(trace_dir):
            run_to_completion(engine)
        wall = time.perf_counter() - start
        steps = engine.stats.steps - steps_before
        totals, span = device_time_per_op(trace_dir)
        try:  # a persistent-cache hit (the cache folder above); if not, ops print unnamed
            sources = op_sources(engine.lower_round().compile().as_text())
        except jax.errors.JaxRuntimeError as err:
            print(f"no HLO text for the op sources: {str(err).splitlines()[0]}")
            sources = {}
        busy = sum(t for t, _ in totals.values())
        # Device launches per step: a captured CUDA command buffer counts once, however many
        # kernels it holds (ops named command_buffer_*).
        launches = sum(c for _, c in totals.values())
        graphs = sum(c for op, (_, c) in totals.items() if "command_buffer" in op)
        print(f"\n== {name} batch {args.batch} ({len(prompts)} requests) {mode}: {steps} steps, "
              f"wall {wall:.2f} s "
              f"({1000 * wall / steps:.2f} ms/step), kernels {busy:.0f} ms "
              f"({busy / steps:.2f} ms/step), kernel span {span:.0f} ms, "
              f"{launches / steps:.0f} launches/step ({graphs / steps:.0f} command buffers)")
        rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
        for op, (ms, count) in rows[:args.top]:
            print(f"{ms / steps:9.3f} ms/step {100 * ms / busy:5.1f}% {count:7d}x  {op[:48]:48s} "
                  f"{sources.get(op, '')[:110]}")
        summary = {"mode": mode, "steps": steps, "wall_s": wall, "kernel_ms": busy,
                   "span_ms": span, "launches": launches, "command_buffers": graphs,
                   "ops": [{"op": n, "ms": ms, "count": c, "source": sources.get(n, "")}
                           for n, (ms, c) in rows]}
        (out / f"summary_{mode}.json").write_text(json.dumps(summary, indent=1))
        del engine  # its cache, before the next mode's


if __name__ == "__main__":
    main()
