"""Kernels against the XLA paths at SDAR-8B shapes, on a GPU (results in docs/kernels.md).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/benchmark_kernels.py --json out.json \\
        [--focus-reference path/to/sands-lab/FOCUS/lmdeploy/pytorch/kernels/cuda/focus.py]

Ragged attention: 32 query heads, 8 KV heads, head dim 128, block 32, bf16; for every slot count,
``kv_len`` (every slot at that length, the cache exactly that long) and retained fraction of the
``S * B`` rows (chosen at random), the median time of:

- ``triton``: our kernel on the compacted rows;
- ``xla``: our reference (queries padded back to one block per slot, masked dense attention);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on the same padded queries
  with ``key_value_seq_lengths`` (plus the scatter to blocks and the gather back, which any
  padded path needs).

Importance (same geometry, half the block masked): XLA reference against our Triton kernel, and,
with ``--focus-reference``, the FOCUS reference implementation's own Triton kernels for
importance and for selection (run with torch on the same inputs; never part of this repository).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from focus_jax import focus
from focus_jax.bench import median_seconds
from pallas_kernels.focus_importance import focus_importance
from pallas_kernels.ragged_attention import ragged_attention
from pallas_kernels.ragged_attention.reference import ragged_attention as attention_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32


def cudnn_attention(q, rows, valid, k_cache, v_cache, layer, kv_len, *, block_size):
    """The padded path through cuDNN flash attention."""
    _, h, d = q.shape
    slots = k_cache.shape[1]
    flat = slots * block_size
    target = jnp.where(valid, rows, flat)
    blocks = jnp.zeros((flat, h, d), q.dtype).at[target].set(q, mode="drop")
    out = jax.nn.dot_product_attention(
        blocks.reshape(slots, block_size, h, d), k_cache[layer], v_cache[layer],
        query_seq_lengths=jnp.full((slots,), block_size, jnp.int32),
        key_value_seq_lengths=kv_len, implementation="cudnn")
    return out.reshape(flat, h, d)[rows]


def attention_cases(slot_counts, kv_lens, fractions, runs, rng):
    impls = {
        "triton": jax.jit(lambda *a: ragged_attention(*a, block_size=BLOCK, impl="triton")),
        "xla": jax.jit(lambda *a: attention_reference(*a, block_size=BLOCK)),
        "cudnn": jax.jit(lambda *a: cudnn_attention(*a, block_size=BLOCK)),
    }
    results = []
    for slots in slot_counts:
        for kv in kv_lens:
            shape = (1, slots, kv, KV_HEADS, HEAD_DIM)
            k_cache = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.bfloat16)
            v_cache = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.bfloat16)
            kv_len = jnp.full((slots,), kv, jnp.int32)
            for fraction in fractions:
                total = slots * BLOCK
                count = max(1, math.ceil(total * fraction))
                rows = jnp.asarray(np.sort(rng.choice(total, count, replace=False)), jnp.int32)
                valid = jnp.ones((count,), bool)
                q = jax.random.normal(jax.random.PRNGKey(2), (count, HEADS, HEAD_DIM), jnp.bfloat16)
                args = (q, rows, valid, k_cache, v_cache, 0, kv_len)
                row = {"slots": slots, "kv_len": kv, "retained": fraction, "rows": count}
                for name, fn in impls.items():
                    try:
                        row[name + "_ms"] = 1e3 * median_seconds(fn, *args, runs=runs)
                    except Exception as error:
                        row[name + "_ms"] = None
                        row[name + "_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                best_xla = min(t for t in (row["xla_ms"], row["cudnn_ms"]) if t is not None)
                row["speedup_vs_best_xla"] = best_xla / row["triton_ms"]
                print(json.dumps(row), flush=True)
                results.append(row)
            del k_cache, v_cache
    return results


def importance_inputs(slots, rng):
    q = jax.random.normal(jax.random.PRNGKey(3), (slots, BLOCK, HEADS, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(4), (slots, BLOCK, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    masked = jnp.asarray(rng.uniform(size=(slots, BLOCK)) < 0.5)
    return q, k, masked


def importance_cases(slot_counts, runs, rng, reference_path):
    results = []
    for slots in slot_counts:
        q, k, masked = importance_inputs(slots, rng)
        row = {"slots": slots, "masked": int(masked.sum())}
        for impl in ("xla", "triton"):
            fn = jax.jit(lambda q, k, m, impl=impl: focus_importance(q, k, m, impl=impl))
            row[impl + "_ms"] = 1e3 * median_seconds(fn, q, k, masked, runs=runs)
        ours = np.asarray(focus_importance(q, k, masked, impl="triton"))
        xla = np.asarray(focus_importance(q, k, masked, impl="xla"))
        row["triton_vs_xla_max_abs"] = float(np.abs(ours - xla).max())

        progress = jnp.asarray(rng.integers(-1, BLOCK // 2, size=slots), jnp.int32)
        avg = jnp.asarray(rng.uniform(1.0, 4.0, size=slots), jnp.float32)
        delta = jnp.asarray(rng.normal(size=(slots, BLOCK)), jnp.float32)
        select = jax.jit(lambda d, m, p, a: focus.select_retained(d, m, p, a, 1.5))
        row["select_xla_ms"] = 1e3 * median_seconds(select, delta, masked, progress, avg, runs=runs)
        if reference_path:
            row.update(reference_kernels(reference_path, q, k, masked, ours, delta, progress, avg,
                                         runs))
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def reference_kernels(path, q, k, masked, ours, delta, progress, avg, runs):
    """The FOCUS reference implementation's Triton kernels, with torch, on the same inputs."""
    import tempfile

    import torch

    if not os.environ.get("TRITON_CACHE_DIR"):  # importing jax-triton empties it
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")
    spec = importlib.util.spec_from_file_location("focus_reference_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cuda = torch.device("cuda")
    slots, b = masked.shape
    to_torch = lambda a, dtype: torch.as_tensor(np.array(a.astype(jnp.float32)), device=cuda).to(dtype)
    q_t = to_torch(q.reshape(slots * b, HEADS, HEAD_DIM), torch.bfloat16)
    k_t = to_torch(k.reshape(slots * b, KV_HEADS, HEAD_DIM), torch.bfloat16)
    masked_np = np.asarray(masked)
    indices = torch.as_tensor(np.flatnonzero(masked_np.reshape(-1)), device=cuda, dtype=torch.int64)
    lengths = masked_np.sum(axis=1)
    indptr = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device=cuda,
                             dtype=torch.int32)
    max_len = int(lengths.max())

    def run_importance():
        return module.focus_importance_ragged(q_t, k_t, indices, indptr, max_len,
                                              HEADS // KV_HEADS, HEAD_DIM ** -0.5)

    theirs = run_importance().float().cpu().numpy()
    ours_masked = ours.reshape(-1)[np.flatnonzero(masked_np.reshape(-1))]

    mask_lengths = torch.as_tensor(lengths, device=cuda, dtype=torch.int32)
    avg_t = torch.as_tensor(np.asarray(avg), device=cuda, dtype=torch.float32)
    current = torch.as_tensor(np.asarray(delta).reshape(-1)[np.flatnonzero(masked_np.reshape(-1))],
                              device=cuda, dtype=torch.float32)
    previous = torch.zeros(slots * b, device=cuda, dtype=torch.float32)
    positions = torch.as_tensor(np.tile(np.arange(b), slots), device=cuda, dtype=torch.int32)
    should = torch.ones(slots, device=cuda, dtype=torch.bool)
    progress_t = torch.as_tensor(np.asarray(progress), device=cuda, dtype=torch.int32)

    def run_select():
        targets = module.focus_compute_targets(mask_lengths, avg_t, 1.5)
        return module.focus_select_and_enforce_ragged(current, previous, indices, positions,
                                                      indptr, targets, should, progress_t,
                                                      max_len)

    def torch_median_ms(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return {"reference_importance_ms": torch_median_ms(run_importance),
            "reference_select_ms": torch_median_ms(run_select),
            "reference_vs_ours_max_rel": float(np.abs(theirs - ours_masked).max()
                                               / np.abs(ours_masked).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="64,256")
    parser.add_argument("--kv-lens", default="512,1024,2048,4096")
    parser.add_argument("--retained", default="0.05,0.1,0.25,0.5,1.0")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--focus-reference", help="the reference repo's kernels/cuda/focus.py")
    parser.add_argument("--ops", default="importance,ragged_attention")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    parse = lambda text, kind: [kind(x) for x in text.split(",")]
    ops = args.ops.split(",")
    result = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d")}
    if "importance" in ops:
        result["importance"] = importance_cases(parse(args.slots, int), args.runs, rng,
                                                args.focus_reference)
    if "ragged_attention" in ops:
        result["ragged_attention"] = attention_cases(
            parse(args.slots, int), parse(args.kv_lens, int), parse(args.retained, float),
            args.runs, rng)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
