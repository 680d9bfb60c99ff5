"""How a random-weight mixture routes the rows a decode step sends to its experts.

The MoE benchmarks (`focus-jax bench --geometry llada2-mini | sdar-30b-a3b`) run random weights
drawn as `bench.random_model` draws them. A trained router spreads tokens over its experts; a
random one need not, and a block's masked rows all enter with the same token (the mask id).
This script draws a geometry's first ``--layers`` layers with the bench's initialisation, runs
sequences of a random prompt followed by one block of masks (a block's first denoising step)
through the uncached block-causal forward (`models.decoder.router_choices`), and reports, per
sparse layer, for the prompt rows and for the mask rows: the (row, expert) pairs, the experts
that get any, the largest share one expert takes, and what uniform routing would give.

    .venv/bin/python scripts/routing_spread.py --geometry llada2-mini --json out.json
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focus_jax.bench import random_prompts
from focus_jax.models import geometry
from focus_jax.models.decoder import Decoder, router_choices


def spread(chosen: np.ndarray, experts: int) -> dict:
    """Statistics of ``chosen [rows, k]`` expert ids over ``experts`` experts."""
    counts = np.bincount(chosen.reshape(-1), minlength=experts)
    pairs = int(counts.sum())
    rng = np.random.default_rng(0)  # uniform routing of as many rows, for comparison
    uniform = np.argsort(rng.random((chosen.shape[0], experts)), axis=1)[:, :chosen.shape[1]]
    uniform_counts = np.bincount(uniform.reshape(-1), minlength=experts)
    return {"rows": int(chosen.shape[0]), "pairs": pairs,
            "experts_used": int((counts > 0).sum()),
            "largest_share": round(float(counts.max() / pairs), 4),
            "uniform_experts_used": int((uniform_counts > 0).sum()),
            "uniform_largest_share": round(float(uniform_counts.max() / pairs), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="llada2-mini")
    parser.add_argument("--layers", type=int, default=3, help="the geometry's first layers")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    cfg = geometry(args.geometry, args.dtype).replace(num_layers=args.layers)
    model = Decoder(cfg, rngs=nnx.Rngs(0))  # bench.random_model's draw (seed 0)
    block = cfg.block_size or 32
    prompts = random_prompts(cfg, [args.prompt_len] * args.sequences, seed=1)
    tokens = jnp.asarray([p + [cfg.mask_token_id] * block for p in prompts], jnp.int32)
    graphdef, params = nnx.split(model)
    chosen = np.asarray(jax.jit(lambda p, t: router_choices(nnx.merge(graphdef, p), t, block))(
        params, tokens))
    report = {"geometry": args.geometry, "layers": args.layers, "dtype": args.dtype,
              "sequences": args.sequences, "prompt_len": args.prompt_len, "block": block,
              "sparse_layers": []}
    for layer, kind in enumerate(cfg.layer_kinds):
        if kind != "sparse":
            continue
        rows = chosen[layer]  # [sequences, positions, k]
        k = rows.shape[-1]
        report["sparse_layers"].append({
            "layer": layer,
            "prompt_rows": spread(rows[:, :args.prompt_len].reshape(-1, k), cfg.moe.num_experts),
            "mask_rows": spread(rows[:, args.prompt_len:].reshape(-1, k), cfg.moe.num_experts)})
        print(json.dumps(report["sparse_layers"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
