"""How long a geometry's decode round takes to compile, alone, from the weights' shapes (no
weights, nothing run, no persistent cache): wall and CPU seconds (all threads) and the
round's memory as XLA plans it (temporaries, arguments, outputs, aliased bytes), then,
with ``--prefills``, the prefill programs ``--workers`` at a time as the server's warm-up
compiles them. One JSON line. Compiler options come from ``XLA_FLAGS``, so each variant is
its own process:

    python3 scripts/compile_round_time.py --geometry sdar-8b --slots 256 --cache-len 2048
    XLA_FLAGS=--xla_gpu_autotune_level=0 python3 scripts/compile_round_time.py ...
    python3 scripts/compile_round_time.py --bucket-ladder 0.0625,0.125,0.25,0.5,1.0 ...
    python3 scripts/compile_round_time.py --processed-ladder 0.25,0.5,0.75,1.0 ...

``--processed-ladder``: the processed rows get a ladder of their own (scripts/processed_ladder.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", default="sdar-8b")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--cache-len", type=int, default=2048)
    parser.add_argument("--mode", default="focus")
    parser.add_argument("--bucket-ladder", default=None, help="default: the platform's")
    parser.add_argument("--kernels", default=None, help="default: the platform's")
    parser.add_argument("--processed-ladder", default=None,
                        help="fractions for the processed rows alone (default: the same ladder)")
    parser.add_argument("--prefills", action="store_true",
                        help="then compile the prefill programs too")
    parser.add_argument("--workers", type=int, default=None,
                        help="prefill programs compiled side by side (default: the warm-up's)")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    # An empty cache folder of its own: every program is compiled, none read back.
    os.environ["FOCUS_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="round_time_")

    import jax

    from focus_jax import bench, compilation
    from focus_jax.cli import _ladder
    from focus_jax.config import GenerationConfig
    from focus_jax.engine import Engine

    if args.processed_ladder:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import processed_ladder

        processed_ladder.use([float(f) for f in args.processed_ladder.split(",")])
    jax.devices()
    model = bench.random_model(args.geometry, abstract=True)
    config = GenerationConfig(mode=args.mode, kernels=args.kernels, **_ladder(args.bucket_ladder))
    engine = Engine(model, config, slots=args.slots, cache_len=args.cache_len, detokenize=False)
    first, *prefills = engine.runner.programs()
    result = {"label": args.label, "geometry": args.geometry, "slots": args.slots,
              "cache_len": args.cache_len, "mode": args.mode, "kernels": args.kernels,
              "ladder": list(engine.runner.settings.retained_ladder),
              "processed_ladder": list(engine.runner.settings.processed_ladder),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0])}
    wall, cpu = time.perf_counter(), cpu_seconds()
    compilation.compile_together([first], workers=1)
    result.update(round_wall_s=round(time.perf_counter() - wall, 2),
                  round_cpu_s=round(cpu_seconds() - cpu, 2))
    print(f"round: {result['round_wall_s']} s wall, {result['round_cpu_s']} s CPU",
          file=sys.stderr, flush=True)
    # The round's memory as XLA plans it (read back from the cache just written): a temporary
    # the size of a cache array would be a copy of the KV cache in the round.
    memory = engine.lower_round().compile().memory_analysis()
    k = engine.state.cache.k
    result.update(kv_array_bytes=math.prod(k.shape) * k.dtype.itemsize,
                  temp_bytes=memory.temp_size_in_bytes,
                  argument_bytes=memory.argument_size_in_bytes,
                  output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes)
    if args.prefills:
        wall, cpu = time.perf_counter(), cpu_seconds()
        compilation.compile_together(prefills, workers=args.workers)
        result.update(prefills=len(prefills), prefills_wall_s=round(time.perf_counter() - wall, 2),
                      prefills_cpu_s=round(cpu_seconds() - cpu, 2),
                      workers=args.workers or compilation.WARMUP_WORKERS)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
