"""Tile configs for tokamax's Mosaic GPU ragged dot at our expert shapes, measured on this GPU.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/tune_grouped_matmul.py \\
        --json tune.json --table pallas_kernels/grouped_matmul/tuned/nvidia_h200.json
    python scripts/tune_grouped_matmul.py --weights int8 --models llada2.0-mini --rows 4096,16384 \
        --json tune_int8.json --table pallas_kernels/grouped_matmul/tuned/nvidia_h200.json

tokamax 0.0.17 ships tuned configs for other GPUs and shapes only; on an H200 at our shapes it
runs its Hopper heuristic (64 x 64 tiles, two pipeline stages, not persistent). For each expert
projection of :data:`MODELS` (gate-up and down) and each row count, every candidate of
:func:`candidates` is compiled (several at once), checked against the heuristic config's
output, and timed (median of ``--runs``, each the mean of ``--calls`` calls queued back to
back, so that the host's dispatch stays hidden); results are printed and written as they come.
``--table`` writes the fastest config per shape and row count into the table
:mod:`pallas_kernels.grouped_matmul.tokamax_mosaic` reads (only a config measured faster than
the heuristic goes in; the shapes tuned in this run replace theirs, the others stay).
``--weights int8`` tunes tokamax's kernel of 8-bit weights (int8, a scale per output channel
and expert, as the quantized experts hold them; bf16 rows and output), whose Hopper heuristic
is 64 x 64 tiles, two stages, persistent.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from pallas_kernels.grouped_matmul import tokamax_mosaic

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchmark_grouped_matmul import MODELS, operands, projections, routed_group_sizes


def candidates(weights: str = "bf16") -> list[dict]:
    """Hopper configs: tiles of 32/64/128 rows x 64 columns (the bf16 output's swizzle width, as
    in tokamax's own Hopper search) x 128 of k, two or four pipeline stages, persistent or not,
    and three grid orders. 8-bit weights: 16/32/64 rows (a memory-bound kernel at a few rows per
    expert) x 128 or 256 of k, and two grid orders."""
    found = []
    if weights == "bf16":
        space = itertools.product((128, 64, 32), (128,), (4, 2), (True, False),
                                  ((0, 1), (1, 4), (1, 8)))
    else:
        space = itertools.product((64, 32, 16), (128, 256), (4, 2), (True, False),
                                  ((0, 1), (1, 4)))
    for block_m, block_k, stages, persistent, (minor, width) in space:
        found.append(dict(block_m=block_m, block_n=64, block_k=block_k, num_stages=stages,
                          split_k=1, persistent=persistent, grid_minor_dim=minor,
                          grid_tile_width=width))
    return found


def kernel(config: dict | None):
    """``(lhs, rhs, group_sizes) -> out`` through tokamax's Mosaic GPU op with this config
    (None: tokamax's own choice), jitted."""
    import tokamax

    impl = [tokamax_mosaic.op(config)] if config else tokamax_mosaic.KERNEL["gpu"]
    out_dtype = jnp.bfloat16  # 8-bit weights: the kernel writes 16-bit tiles only
    return jax.jit(lambda a, b, c: tokamax.ragged_dot(a, b, c, preferred_element_type=out_dtype,
                                                      implementation=impl))


def seconds(fn, args, runs: int, calls: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def tune_case(model: str, projection: str, rows: int, args, emit) -> None:
    _, _, experts, top_k = MODELS[model]
    k, n = projections(model)[projection]
    sizes = routed_group_sizes(rows, experts, top_k, np.random.default_rng(rows))
    used = int(sizes.sum())
    lhs, rhs, group_sizes = operands(used, k, n, sizes, seed=rows)
    weights = None if args.weights == "bf16" else args.weights  # as tuned tables name them
    if weights:
        rhs = qwix.quantize(rhs, jnp.dtype(weights), channelwise_axes=(0, 2))
    flops = 2 * used * k * n
    configs = [None, *candidates(args.weights)]
    fns = [kernel(c) for c in configs]

    def compile_one(i):
        try:
            return fns[i].lower(lhs, rhs, group_sizes).compile()
        except Exception as err:  # a config this kernel refuses at this shape
            return err

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        compiled = list(pool.map(compile_one, range(len(configs))))
    compile_s = time.perf_counter() - start
    want = None
    for config, exe in zip(configs, compiled, strict=True):
        row = {"model": model, "projection": projection, "rows": used, "k": k, "n": n,
               "experts": experts, "weights": weights, "config": config}
        if isinstance(exe, Exception):
            row["failed"] = str(exe).strip().splitlines()[0][:200]
        else:
            out = exe(lhs, rhs, group_sizes).astype(jnp.float32)
            if want is None:
                want = out
            row["max_abs_diff_to_heuristic"] = float(jnp.abs(out - want).max())
            s = seconds(exe, (lhs, rhs, group_sizes), args.runs, args.calls)
            row.update(ms=1e3 * s, tflops=flops / s / 1e12)
        emit(row)
    emit({"model": model, "projection": projection, "rows": used,
          "compile_s_all_candidates": compile_s})


def table(rows: list[dict]) -> dict:
    """The fastest checked config per (k, n, experts) and row count, where it beats the
    heuristic."""
    cases = {}
    for row in rows:
        if "tflops" in row and row.get("max_abs_diff_to_heuristic", 1.0) < 0.05:
            key = tokamax_mosaic.shape_key(row["k"], row["n"], row["experts"], row.get("weights"))
            cases.setdefault((key, row["rows"]), []).append(row)
    out = {}
    for (key, used), found in sorted(cases.items()):
        heuristic = next((r for r in found if r["config"] is None), None)
        best = max(found, key=lambda r: r["tflops"])
        if heuristic is None or best["config"] is None:
            continue
        out.setdefault(key, []).append(
            {"rows": used, "config": best["config"], "tflops": round(best["tflops"], 1),
             "heuristic_tflops": round(heuristic["tflops"], 1)})
    return out


def write_table(path: Path, result: dict) -> None:
    """The tuned table of ``result``'s rows merged into the one at ``path`` (its other shapes
    kept)."""
    shapes = json.loads(path.read_text())["shapes"] if path.exists() else {}
    shapes.update(table(result["rows"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tuned = {"device_kind": result["device"], "tokamax": "0.0.17", "date": result["date"],
             "shapes": dict(sorted(shapes.items()))}
    path.write_text(json.dumps(tuned, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default="65536,16384,4096", help="tokens x top-k, comma-separated")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--workers", type=int, default=8, help="candidates compiled at once")
    parser.add_argument("--json", required=True, help="every measurement, written as it comes")
    parser.add_argument("--table", help="write the tuned table here (merged into the file's)")
    parser.add_argument("--weights", choices=("bf16", "int8"), default="bf16",
                        help="the experts' weights: bf16, or int8 with per-channel scales")
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    if why := tokamax_mosaic.unsupported(jax.ShapeDtypeStruct((8, 64), jnp.bfloat16),
                                         jax.ShapeDtypeStruct((1, 64, 64), jnp.bfloat16), "gpu"):
        sys.exit(f"tune_grouped_matmul: {why}")
    result = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
              "jax": jax.__version__, "rows": []}

    def emit(row):
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    for rows in (int(r) for r in args.rows.split(",")):
        for model in args.models.split(","):
            for projection in projections(model):
                tune_case(model, projection, rows, args, emit)
                if args.table:
                    write_table(Path(args.table), result)


if __name__ == "__main__":
    main()
