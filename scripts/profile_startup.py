"""Where a server's start-up goes: the steps of ``focus-jax serve`` before it listens, timed one
by one in this process (importing, loading the model, building the engine, every program's
compile or cache read, the warm-up runs). One JSON object.

    python3 scripts/profile_startup.py --model /tmp/sdar8b --slots 256 --cache-len 2048 \\
        --cache-dir /tmp/xla_cache --json start.json

``--workers N`` sets how many programs compile side by side (``compilation.WARMUP_WORKERS``;
1 gives each program's own compile time). ``--no-cache`` runs without the persistent cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

START = time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--cache-len", type=int, default=2048)
    parser.add_argument("--mode", default="focus")
    parser.add_argument("--bucket-ladder", default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    if args.cache_dir is not None:
        os.environ["FOCUS_JAX_CACHE_DIR"] = str(args.cache_dir)
    times: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[name] = round(now - mark, 3)
        mark = now
        print(f"{name}: {times[name]:.2f} s", file=sys.stderr, flush=True)

    import jax
    from jax import monitoring

    from focus_jax import compilation
    from focus_jax.checkpoint import load
    from focus_jax.cli import _ladder
    from focus_jax.config import GenerationConfig
    from focus_jax.engine import Engine

    jax.devices()
    lap("import and device start")
    if not args.no_cache:
        compilation.use_persistent_cache()
    if args.workers is not None:
        compilation.WARMUP_WORKERS = args.workers
    events: list[dict] = []

    def on_duration(event: str, duration: float, **kwargs: object) -> None:
        if "compile" in event or "cache" in event:
            events.append({"event": event, "s": round(duration, 3),
                           "at": round(time.perf_counter() - START, 3)})
            if event == compilation.BACKEND_COMPILE:
                print(f"  compiled or read a program in {duration:.2f} s", file=sys.stderr,
                      flush=True)

    monitoring.register_event_duration_secs_listener(on_duration)

    model = load(args.model)
    jax.block_until_ready(model.params)
    lap("load model")
    config = GenerationConfig(mode=args.mode, **_ladder(args.bucket_ladder))
    engine = Engine(model, config, slots=args.slots, cache_len=args.cache_len)
    jax.block_until_ready(engine.state)
    lap("engine (decode state)")
    with compilation.count_compilations() as seen:
        engine.warmup()
    lap("warm-up (compile + run)")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "times": times,
              "total_s": round(time.perf_counter() - START, 3),
              "compiled": seen.compiled, "loaded": seen.loaded,
              "compile_or_load_s": round(seen.seconds, 3),
              "warmup_workers": compilation.WARMUP_WORKERS,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "backend_compiles_s": [e["s"] for e in events
                                     if e["event"] == compilation.BACKEND_COMPILE],
              "events": events, "device": str(jax.devices()[0])}
    print(json.dumps({k: v for k, v in result.items() if k != "events"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
