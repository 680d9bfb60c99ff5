"""Throughput of the three modes on a named geometry with random weights (or a checkpoint).

    python scripts/benchmark.py --geometry sdar-8b --batches 32,64,128,256 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax

from focus_jax import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="sdar-1.7b")
    parser.add_argument("--model", default=None, help="a model folder instead of a geometry")
    parser.add_argument("--batches", default="64")
    parser.add_argument("--requests-per-slot", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--modes", default="baseline,delayed,focus")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    if args.model:
        from focus_jax import load
        model = load(args.model)
    else:
        model = bench.random_model(args.geometry)
    peak = bench.measured_bf16_peak()
    print(f"device {jax.devices()[0].device_kind}; measured bf16 peak {peak / 1e12:.0f} TFLOP/s")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for r in bench.run(model, args.modes.split(","), batch, batch * args.requests_per_slot,
                           args.max_new_tokens):
            row = {**dataclasses.asdict(r), "tokens_per_second": r.tokens_per_second,
                   "step_ms": r.step_ms, "mfu": r.mfu(peak), "peak_flops": peak,
                   "model": args.model or args.geometry}
            rows.append(row)
            print(f"{row['model']} bs{batch} {r.mode:8s} {r.tokens_per_second:8.1f} tok/s  "
                  f"step {r.step_ms:6.2f} ms  processed {r.processed_per_step:7.1f}  "
                  f"retained {r.retained_per_step:7.1f}  decoded {r.decoded_per_step:6.2f}  "
                  f"MFU {100 * r.mfu(peak):5.1f}%  compile {r.compile_seconds:5.1f}s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
