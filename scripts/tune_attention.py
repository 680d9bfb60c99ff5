"""Tile sizes and launch settings of the Triton ragged-attention kernel, on a GPU.

    python scripts/tune_attention.py --json out.json

SDAR-8B attention geometry (32 query heads, 8 KV heads, head dim 128, block 32, bf16), one
layer's cache of ``--positions`` positions for ``--slots`` slots. Each slot's ``kv_len`` is drawn
uniformly from ``[kv/2, 3kv/2]`` (multiples of the block); the ``fraction`` of the ``S * B`` rows
is chosen at random, so the rows per slot vary as they do in a decode step. For every
``(block_m, block_n, num_warps, num_stages)`` the time of one call is the median over ``--runs``
of ten calls inside one jitted loop, divided by ten. Results are checked against the pure-jnp
reference once per case.
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from benchmark_kernels import BLOCK, HEAD_DIM, HEADS, KV_HEADS, median_seconds  # scripts/

from pallas_kernels.ragged_attention.reference import ragged_attention as reference
from pallas_kernels.ragged_attention.triton_gpu import ragged_attention

CALLS = 10


def case_inputs(slots, positions, kv, fraction, rng):
    shape = (1, slots, positions, KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    v_cache = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    lengths = rng.integers(kv // 2 // BLOCK, 3 * kv // 2 // BLOCK + 1, size=slots) * BLOCK
    kv_len = jnp.asarray(np.clip(lengths, BLOCK, positions), jnp.int32)
    total = slots * BLOCK
    count = max(1, round(total * fraction))
    rows = jnp.asarray(np.sort(rng.choice(total, count, replace=False)), jnp.int32)
    q = jax.random.normal(jax.random.key(2), (count, HEADS, HEAD_DIM), jnp.bfloat16)
    return q, rows, jnp.ones((count,), bool), k_cache, v_cache, kv_len


def timed(config, q, rows, valid, k_cache, v_cache, kv_len, runs):
    def attend(q, rows, valid, k_cache, v_cache, kv_len):
        return ragged_attention(q, rows, valid, k_cache, v_cache, 0, kv_len, block_size=BLOCK,
                                **config)

    @jax.jit
    def loop(q, *rest):  # the cache is an argument: captured, it would become a constant
        return jax.lax.fori_loop(0, CALLS, lambda _, x: attend(x, *rest), q)

    args = (q, rows, valid, k_cache, v_cache, kv_len)
    return median_seconds(loop, *args, runs=runs) / CALLS, jax.jit(attend)(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--kv", default="512,1024")
    parser.add_argument("--fractions", default="0.25,1.0")
    parser.add_argument("--block-m", default="32,64,128")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]
    configs = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in
               itertools.product(ints(args.block_m), ints(args.block_n), ints(args.warps),
                                 ints(args.stages))]
    rng = np.random.default_rng(0)
    results = []
    for kv, fraction in itertools.product(ints(args.kv), [float(f) for f in args.fractions.split(",")]):
        inputs = case_inputs(args.slots, args.positions, kv, fraction, rng)
        expected = np.asarray(reference(*inputs[:5], 0, inputs[5], block_size=BLOCK), np.float32)
        case = {"slots": args.slots, "kv": kv, "fraction": fraction, "rows": int(inputs[0].shape[0]),
                "cache_gb": float(inputs[5].sum()) * KV_HEADS * HEAD_DIM * 4 / 1e9}
        for config in configs:
            row = dict(case, **config)
            try:
                seconds, out = timed(config, *inputs, runs=args.runs)
                row["ms"] = 1e3 * seconds
                row["max_abs_err"] = float(np.abs(np.asarray(out, np.float32) - expected).max())
                row["tb_per_s"] = case["cache_gb"] / seconds / 1e3
            except Exception as error:  # e.g. shared memory exceeded for this tile
                row["error"] = f"{type(error).__name__}: {str(error)[:160]}"
            print(json.dumps(row), flush=True)
            results.append(row)
        done = [r for r in results if r["kv"] == kv and r["fraction"] == fraction and "ms" in r]
        best = min(done, key=lambda r: r["ms"])
        print("BEST", json.dumps(best), flush=True)
        del inputs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
