"""The grouped matmul's backends at mixture-of-experts shapes, on a GPU (or tiny, on a CPU).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/benchmark_grouped_matmul.py --check \\
        --json grouped_matmul.json
    python scripts/benchmark_grouped_matmul.py --rows 64 --quick      # a CPU smoke run

For each model's expert projections (gate-up ``[E, hidden, 2 * width]``, down ``[E, width,
hidden]``, bf16) and each row count (tokens x top-k; every token routed to top-k distinct
experts drawn uniformly at random, so some groups can be empty), the median wall time of one
jitted call with its result waited for, after a compile and warm-up calls; TFLOP/s count the
useful ``2 * rows * k * n`` against a measured bf16 dense matmul (``focus_jax.bench``).

Backends: ``xla`` and ``tokamax`` through :func:`pallas_kernels.grouped_matmul.grouped_matmul`
(padding rows masked to zeros), and ``tokamax_kernel`` (tokamax's ``ragged_dot`` called
directly, no mask: what the mask costs). A backend that cannot run here is recorded with why.
``--check`` first holds every backend to the reference at each projection's ``k`` and ``n``
with 8 experts, one left empty, and padding rows; a mismatch ends the run (exit status 1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from focus_jax.bench import measured_bf16_peak, median_seconds
from pallas_kernels.dispatch import target_platform
from pallas_kernels.grouped_matmul import grouped_matmul, reference, tokamax_mosaic

MODELS = {
    # hidden, expert width, experts, experts per token
    "sdar-30b-a3b": (2048, 768, 128, 8),
    "llada2.0-mini": (2048, 512, 256, 8),
}
BACKENDS = ("xla", "tokamax", "tokamax_kernel")


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(k, n) of each expert projection: gate and up fused, then down."""
    hidden, width, _, _ = MODELS[model]
    return {"gate_up": (hidden, 2 * width), "down": (width, hidden)}


def routed_group_sizes(rows: int, experts: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """Rows per expert when ``rows // top_k`` tokens each pick ``top_k`` distinct experts
    uniformly at random (``rows`` rounded down to whole tokens)."""
    tokens = rows // top_k
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def backend(name: str, lhs: jax.Array, rhs: jax.Array) -> Callable[..., jax.Array]:
    """A jitted ``(lhs, rhs, group_sizes) -> out`` for a backend name of :data:`BACKENDS`;
    ``ValueError`` where it cannot multiply these operands here."""
    if name == "tokamax_kernel":
        if why := tokamax_mosaic.unsupported(lhs, rhs, target_platform()):
            raise ValueError(why)
        import tokamax

        kernel = tokamax_mosaic.KERNEL[target_platform()]
        return jax.jit(lambda a, b, c: tokamax.ragged_dot(a, b, c, implementation=kernel))
    return jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=name))


def operands(rows: int, k: int, n: int, sizes: np.ndarray, seed: int):
    keys = jax.random.split(jax.random.key(seed), 2)
    lhs = (jax.random.normal(keys[0], (rows, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (len(sizes), k, n), jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes)


def check(models: list[str], backends: list[str], rows: int) -> list[dict]:
    """Every backend against the reference at each projection's ``k`` and ``n``: 8 experts
    (the fourth empty), an eighth of the rows padding. Float32 results of bf16 operands."""
    found = []
    sizes = np.full(8, rows * 7 // 8 // 7, np.int32)
    sizes[3] = 0
    sizes[-1] += rows * 7 // 8 - sizes.sum()
    for model in models:
        for projection, (k, n) in projections(model).items():
            lhs, rhs, group_sizes = operands(rows, k, n, sizes, seed=1)
            want = np.asarray(reference.grouped_matmul(lhs, rhs, group_sizes,
                                                       preferred_element_type=jnp.float32))
            used = int(sizes.sum())
            for name in backends:
                row = {"model": model, "projection": projection, "rows": rows, "impl": name}
                try:
                    got = backend(name, lhs, rhs)(lhs, rhs, group_sizes)
                    got = np.asarray(got.astype(jnp.float32))
                except ValueError as err:  # cannot run here
                    row["skipped"] = str(err)
                else:
                    row["max_abs_error"] = float(np.abs(got[:used] - want[:used]).max())
                    row["padding_max_abs"] = float(np.abs(got[used:]).max())
                    # Results of about unit size in bf16: rounding stays near 0.01.
                    row["ok"] = row["max_abs_error"] < 0.05 and (
                        name == "tokamax_kernel" or row["padding_max_abs"] == 0.0)
                print(json.dumps(row), flush=True)
                found.append(row)
    return found


WEIGHTS = {"bf16": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
"""The experts' weight types: bf16, or 8 bits with a scale per output channel and expert
(qwix, as ``focus_jax`` quantizes experts; the rows stay bf16)."""


def timings(models: list[str], backends: list[str], row_counts: list[int], peak: float,
            runs: int, warmup: int, weights: tuple[str, ...] = ("bf16",)) -> list[dict]:
    rng = np.random.default_rng(0)
    found = []
    for model in models:
        _, _, experts, top_k = MODELS[model]
        for rows in row_counts:
            sizes = routed_group_sizes(rows, experts, top_k, rng)
            used = int(sizes.sum())
            for projection, (k, n) in projections(model).items():
                lhs, plain, group_sizes = operands(used, k, n, sizes, seed=rows)
                flops = 2 * used * k * n
                for weight, name in itertools.product(weights, backends):
                    rhs = plain if WEIGHTS[weight] is None else qwix.quantize(
                        plain, WEIGHTS[weight], channelwise_axes=(0, 2))
                    row = {"model": model, "projection": projection, "rows": used, "k": k, "n": n,
                           "experts": experts, "empty_experts": int((sizes == 0).sum()),
                           "weights": weight, "impl": name}
                    try:
                        seconds = median_seconds(backend(name, lhs, rhs), lhs, rhs, group_sizes,
                                                 runs=runs, warmup=warmup)
                    except ValueError as err:
                        row["skipped"] = str(err)
                    except jax.errors.JaxRuntimeError as err:  # XLA's dense expansion: OOM
                        row["failed"] = str(err).strip().splitlines()[0][:300]
                    else:
                        row.update(ms=1e3 * seconds, tflops=flops / seconds / 1e12,
                                   fraction_of_peak=flops / seconds / peak)
                    print(json.dumps(row), flush=True)
                    found.append(row)
                del lhs, plain, rhs
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default="2048,8192,65536", help="tokens x top-k, comma-separated")
    parser.add_argument("--impls", default=",".join(BACKENDS))
    parser.add_argument("--weights", default="bf16",
                        help=f"the experts' weights, comma-separated: {', '.join(WEIGHTS)}")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="hold each backend to the reference first")
    parser.add_argument("--quick", action="store_true",
                        help="3 runs after 1 warm-up, a 1024 peak matmul, a 64-row check")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    models, backends = args.models.split(","), args.impls.split(",")
    for name in models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    for name in backends:
        if name not in BACKENDS:
            parser.error(f"unknown impl {name!r}: choose from {', '.join(BACKENDS)}")
    weights = tuple(args.weights.split(","))
    if unknown := set(weights) - set(WEIGHTS):
        parser.error(f"unknown weights {', '.join(sorted(unknown))}: choose from {', '.join(WEIGHTS)}")
    runs, warmup = (3, 1) if args.quick else (args.runs, args.warmup)
    logging.getLogger("absl").setLevel(logging.ERROR)  # tokamax: a cache-miss warning per shape

    result = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
              "jax": jax.__version__}
    if tokamax_mosaic.installed():
        import tokamax

        result["tokamax"] = tokamax.__version__
    if args.check:
        result["check"] = check(models, backends, rows=64 if args.quick else 256)
        if not all(row.get("ok", True) for row in result["check"]):
            print("check failed: a backend disagrees with the reference", file=sys.stderr)
            sys.exit(1)
    peak = measured_bf16_peak(1024 if args.quick else None)
    result["bf16_peak_tflops"] = peak / 1e12
    print(json.dumps({"bf16_peak_tflops": peak / 1e12}), flush=True)
    result["timings"] = timings(models, backends, [int(r) for r in args.rows.split(",")], peak,
                                runs, warmup, weights)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
