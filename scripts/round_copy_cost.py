"""What copying a decode round's results to the host costs: the fields one by one (as before
``decoding.pack_round``), one packed array of per-position flags and whole sequences (its first
form), one of per-step counts and sequence windows (its form now), and a scalar alone.

    python scripts/round_copy_cost.py --slots 256 --steps 16 --block 32 --positions 1536

Each variant produces fresh device arrays (a tiny program), then copies them with
``jax.device_get``; the median of ``--repeats`` copies is printed in ms (JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from focus_jax import decoding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--positions", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    s, t, b, m = args.slots, args.steps, args.block, args.positions
    packed_before = 4 + t * b + 3 * t + m  # per-position flags and the whole sequence
    width = decoding.packed_width(t, b, m)  # decoding.pack_round's array today

    def fields(x):  # the shapes and dtypes runner.decode_round copied field by field
        return ((jnp.zeros((t, s, b), bool) | (x > 0),) * 4 + (jnp.zeros((t, s), bool),)
                + (jnp.zeros((t,), jnp.int32) + x,) * 2 + (x,)
                + (jnp.zeros((s,), bool), jnp.zeros((s,), jnp.int32) + x,
                   jnp.zeros((s,), jnp.int32), jnp.zeros((s, m), jnp.int32) + x))

    variants = {
        "fields_one_by_one": jax.jit(fields),
        "one_packed_array_flags_and_sequence": jax.jit(
            lambda x: jnp.zeros((s, packed_before), jnp.int32) + x),
        "one_packed_array_counts_and_window": jax.jit(
            lambda x: jnp.zeros((s, width), jnp.int32) + x),
        "one_scalar": jax.jit(lambda x: x + 1),
    }
    result = {"device": jax.devices()[0].device_kind, "slots": s, "steps": t, "block": b,
              "positions": m}
    for name, make in variants.items():
        jax.device_get(make(jnp.int32(0)))
        times = []
        for i in range(args.repeats):
            out = jax.block_until_ready(make(jnp.int32(i)))
            start = time.perf_counter()
            jax.device_get(out)
            times.append(1e3 * (time.perf_counter() - start))
        result[f"{name}_ms"] = statistics.median(times)
        print(f"{name}: {result[f'{name}_ms']:.3f} ms (min {min(times):.3f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
