"""Where a program call's time goes on the host and the device: a profiler timeline of a few
calls, every event kept.

    python scripts/trace_calls.py --geometry sdar-8b --batch 256 --requests 8 --out trace

A few requests in many slots (a server below saturation), warmed up, then traced: ``--calls``
calls of a program that adds one to a scalar (each read back), then ``--calls`` of the engine's
decode rounds of ``--round-steps`` steps with their copy to the host. Writes the events of every
plane and line (host threads, device streams, copies) with their start (us from the first
event), duration and name to ``--out``/events.jsonl.gz, and prints, per call, when the host
started it, when its first and last device work ran and when the host had its result.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.profiler import ProfileData

from focus_jax import bench
from focus_jax.engine import run_to_completion


def events(trace_dir: str) -> list[dict]:
    """Every event of the trace under ``trace_dir``: plane, line, name, start and duration (ns)."""
    found = []
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                for event in line.events:
                    found.append({"plane": plane.name, "line": line.name, "name": event.name,
                                  "start_ns": event.start_ns, "ns": event.duration_ns})
    return sorted(found, key=lambda e: e["start_ns"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_light_load_arguments(parser)
    parser.add_argument("--round-steps", type=int, default=4)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--out", default="trace")
    args = parser.parse_args()

    engine, prompts = bench.light_load(args.geometry, args.batch, args.requests, args.cache_len,
                                       mode="focus", kernels=args.kernels)
    running = bench.start_long_requests(engine, prompts)
    runner = engine.runner
    add_one = jax.jit(lambda x: x + 1)
    scalar = jnp.int32(0)
    for _ in range(3):  # warm
        scalar = add_one(scalar)
        int(scalar)
        runner.decode_round(False, args.round_steps)
    marks = []
    out = Path(args.out)
    with jax.profiler.trace(str(out)):
        for i in range(args.calls):
            with jax.profiler.TraceAnnotation(f"mark scalar call {i}"):
                start = time.perf_counter()
                scalar = add_one(scalar)
                int(scalar)
                marks.append(("scalar", 1e3 * (time.perf_counter() - start)))
        for i in range(args.calls):
            with jax.profiler.TraceAnnotation(f"mark round {i}"):
                start = time.perf_counter()
                runner.decode_round(False, args.round_steps)
                marks.append(("round", 1e3 * (time.perf_counter() - start)))
    for kind, ms in marks:
        print(f"{kind}: {ms:.3f} ms (host clock)")
    found = events(str(out))
    origin = found[0]["start_ns"] if found else 0
    with gzip.open(out / "events.jsonl.gz", "wt") as f:
        for e in found:
            f.write(json.dumps({**e, "start_us": (e["start_ns"] - origin) / 1e3,
                                "us": e["ns"] / 1e3}) + "\n")
    # Per marked call: the device work inside its window.
    for mark in (e for e in found if e["name"].startswith("mark ")):
        lo, hi = mark["start_ns"], mark["start_ns"] + mark["ns"]
        inside = [e for e in found if lo <= e["start_ns"] < hi and e is not mark]
        device = [e for e in inside if e["plane"].startswith("/device:")]
        if not device:
            print(f"{mark['name']}: {mark['ns'] / 1e3:.0f} us, no device events")
            continue
        first = min(e["start_ns"] for e in device)
        last = max(e["start_ns"] + e["ns"] for e in device)
        busy = sum(e["ns"] for e in device)
        print(f"{mark['name']}: {mark['ns'] / 1e3:.0f} us; device work from +{(first - lo) / 1e3:.0f}"
              f" to +{(last - lo) / 1e3:.0f} us, busy {busy / 1e3:.0f} us in {len(device)} events;"
              f" host done {(hi - last) / 1e3:.0f} us after the last device event")
    for rid in running:
        engine.abort(rid)
    run_to_completion(engine)


if __name__ == "__main__":
    main()
