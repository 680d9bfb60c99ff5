"""Compile the TPU kernels at engine shapes for TPU chips, on a CPU machine (docs/kernels.md).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python scripts/compile_tpu_kernels.py \\
        [--slots 32] [--positions 2048] [--json out.json]

Needs libtpu (``pip install 'focus-jax[tpu]'``). Per named geometry (bf16, block 32) and chip
generation: ragged attention over ``slots * 32`` rows and the layer stack's cache, and FOCUS
importance of ``slots`` blocks, each compiled alone for one chip; then both through their
sharded entry points inside a ``shard_map`` over ``data`` on v5e 2x4 (data=2, model=4), as the
decode step calls them. Prints one JSON line per compile: compile seconds, the chosen KV block,
and the compiler's memory per chip (arguments: the caches or
blocks; temporaries: what the program adds). Nothing runs; nothing is timed on a TPU.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from focus_jax import tpu
from focus_jax.models import GEOMETRIES
from pallas_kernels.focus_importance import focus_importance, focus_importance_sharded
from pallas_kernels.ragged_attention import ragged_attention, ragged_attention_sharded
from pallas_kernels.ragged_attention.pallas_tpu import choose_block_kv, sublane_tile

BLOCK = 32
DTYPE = jnp.bfloat16
ONE_CHIP = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "v5p": "v5p:1x1x1"}


def shapes(geometry: dict, slots: int, positions: int) -> dict:
    heads, kv_heads, head_dim = geometry["num_heads"], geometry["num_kv_heads"], geometry["head_dim"]
    cache = (geometry["num_layers"], slots, positions, kv_heads, head_dim)
    return {"q": (slots * BLOCK, heads, head_dim), "cache": cache,
            "blocks_q": (slots, BLOCK, heads, head_dim),
            "blocks_k": (slots, BLOCK, kv_heads, head_dim)}


def report(name: str, where: str, mesh, jitted, *inputs) -> dict:
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
            for shape, dtype, spec in inputs]
    result = tpu.compile_program(mesh, jitted, *args)
    row = {"kernel": name, "where": where, "compiled": result.compiled,
           "compile_s": round(result.seconds, 2), "error": result.error}
    if result.memory:
        row["arguments_gib"] = round(result.memory.arguments / tpu.GIB, 3)
        row["temporaries_mib"] = round(result.memory.temporaries / 2**20, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name, (_, geometry) in GEOMETRIES.items():
        s = shapes(geometry, args.slots, args.positions)
        n, (heads, head_dim) = s["q"][0], s["q"][1:]
        kv_heads = geometry["num_kv_heads"]
        tile = -(-BLOCK * heads // kv_heads // sublane_tile(DTYPE)) * sublane_tile(DTYPE)
        block_kv = choose_block_kv(args.positions, tile, kv_heads, head_dim, DTYPE)
        attention_inputs = [(s["q"], DTYPE, P()), ((n,), jnp.int32, P()), ((n,), jnp.bool_, P()),
                            (s["cache"], DTYPE, P()), (s["cache"], DTYPE, P()),
                            ((args.slots,), jnp.int32, P())]
        importance_inputs = [(s["blocks_q"], DTYPE, P()), (s["blocks_k"], DTYPE, P()),
                             ((args.slots, BLOCK), jnp.bool_, P())]

        def attend(q, rows, valid, k, v, kv_len):
            return ragged_attention(q, rows, valid, k, v, 3, kv_len, block_size=BLOCK,
                                    impl="pallas_tpu")

        importance = jax.jit(lambda q, k, m: focus_importance(q, k, m, impl="pallas_tpu"))
        for generation, topology in ONE_CHIP.items():
            mesh = tpu.make_mesh(tpu.parse_topology(topology), 1, 1)
            where = f"one {generation} chip"
            rows.append({"geometry": name, "block_kv": block_kv,
                         **report("ragged_attention", where, mesh, jax.jit(attend),
                                  *attention_inputs)})
            rows.append({"geometry": name,
                         **report("focus_importance", where, mesh, importance,
                                  *importance_inputs)})
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
        rows.append({"geometry": name, **sharded(s, args.slots)})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def sharded(s: dict, slots: int) -> dict:
    """Both ops through their entry points inside a shard_map over data, on v5e 2x4."""
    mesh = tpu.make_mesh(tpu.parse_topology("v5e:2x4"), 2, 4)
    local = slots // 2

    def per_shard(q, rows, valid, k, v, kv_len, blocks_q, blocks_k, masked):
        attn = ragged_attention_sharded(mesh, q, rows, valid, k, v, 3, kv_len, block_size=BLOCK,
                                        impl="pallas_tpu")
        return attn, focus_importance_sharded(mesh, blocks_q, blocks_k, masked, impl="pallas_tpu")

    def step(*args):
        cache = P(None, "data")
        return jax.shard_map(per_shard, mesh=mesh, axis_names={"data"},
                             in_specs=(P("data"),) * 3 + (cache, cache) + (P("data"),) * 4,
                             out_specs=(P("data"), P("data")))(*args)

    n = slots * BLOCK
    cache = (s["cache"], DTYPE, P(None, "data", None, "model"))
    heads = P("data", None, "model")
    return report("both, sharded", f"v5e 2x4 data=2 model=4 ({local} slots per shard)", mesh,
                  jax.jit(step), (s["q"], DTYPE, P("data", "model")), ((n,), jnp.int32, P("data")),
                  ((n,), jnp.bool_, P("data")), cache, cache, ((slots,), jnp.int32, P("data")),
                  (s["blocks_q"], DTYPE, heads), (s["blocks_k"], DTYPE, heads),
                  ((slots, BLOCK), jnp.bool_, P("data")))


if __name__ == "__main__":
    main()
