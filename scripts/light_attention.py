"""The ragged attention of a lightly loaded step, alone, per GPU kernel: device time per call
from a profiler trace (host latency left out).

    python scripts/light_attention.py --slots 256 --live 8 --kv-len 700 --json out.json

``--live`` of ``--slots`` slots hold ``r`` compacted query rows each (for each ``r`` of
``--rows-per-slot``), the rows padded to the next power of two (a bucket); every slot's cache
holds ``--kv-len`` positions. For the jax-triton kernel and the Pallas Triton one (with its
default split cache walks, and unsplit), ``--calls`` chained calls run in one program under
``jax.profiler.trace``; the device time of everything they launch (the kernel and what XLA adds
around it), and of kernels named ``ragged_attention*`` alone, is reported per call.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.profiler import ProfileData

from pallas_kernels.ragged_attention import ragged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32


def device_us(trace_dir: str) -> tuple[float, float]:
    """Total device kernel time in the trace, and that of kernels named ``ragged_attention*``."""
    total = attention = 0.0
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue
                for event in line.events:
                    if event.name.startswith("Memcpy"):
                        continue
                    total += event.duration_ns / 1e3
                    if event.name.startswith("ragged_attention"):
                        attention += event.duration_ns / 1e3
    return total, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--live", type=int, default=8)
    parser.add_argument("--kv-len", type=int, default=700)
    parser.add_argument("--rows-per-slot", default="4,16,32")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    positions = -(-args.kv_len // BLOCK) * BLOCK + BLOCK
    shape = (1, args.slots, positions, KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    v_cache = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    kv_len = jnp.full((args.slots,), args.kv_len, jnp.int32)
    live = np.linspace(0, args.slots - 1, args.live).astype(int)
    kernels = {impl: functools.partial(ragged_attention, impl=impl)
               for impl in ("triton", "pallas_triton")}
    kernels["pallas_triton_unsplit"] = functools.partial(ragged_attention, impl="pallas_triton",
                                                         kv_splits=1)
    results = []
    for per_slot in (int(r) for r in args.rows_per_slot.split(",")):
        count = args.live * per_slot
        bucket = 1 << (count - 1).bit_length()
        rows = np.full((bucket,), 0, np.int32)
        rows[:count] = (live[:, None] * BLOCK + np.arange(per_slot)[None, :]).reshape(-1)
        valid = np.arange(bucket) < count
        q = jax.random.normal(jax.random.key(2), (bucket, HEADS, HEAD_DIM), jnp.bfloat16)
        row = {"slots": args.slots, "live": args.live, "kv_len": args.kv_len,
               "rows_per_slot": per_slot, "bucket": bucket, "device": jax.devices()[0].device_kind}
        reference = None
        for name, kernel in kernels.items():
            def chained(q, rows, valid, k, v, kv_len, kernel=kernel):
                for _ in range(args.calls):
                    q = kernel(q, rows, valid, k, v, 0, kv_len, block_size=BLOCK)
                return q

            program = jax.jit(chained)
            out = jax.block_until_ready(program(q, rows, valid, k_cache, v_cache, kv_len))
            if reference is None:
                reference = np.asarray(out[:count], np.float32)
            row[f"{name}_max_abs_diff"] = float(np.abs(np.asarray(out[:count], np.float32)
                                                       - reference).max())
            trace_dir = tempfile.mkdtemp()
            with jax.profiler.trace(trace_dir):
                jax.block_until_ready(program(q, rows, valid, k_cache, v_cache, kv_len))
            total, attention = device_us(trace_dir)
            row[f"{name}_us_per_call"] = total / args.calls
            row[f"{name}_kernel_us_per_call"] = attention / args.calls
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
