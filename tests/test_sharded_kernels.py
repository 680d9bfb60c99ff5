"""The sharded kernel entry points equal the unsharded ops.

CPU (``make test``): this file re-runs itself in a fresh process with 8 forced host devices and
compares, on meshes (8, 1), (2, 4) and (1, 8), with the XLA path and the TPU kernels in the
Pallas interpreter, both where the entry point makes every mesh axis manual and inside a
``shard_map`` over ``data`` (as the decode step calls it). GPU (``make test-gpu``): the
Triton kernels through the entry points on a one-device mesh.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from focus_jax.compaction import compact
from focus_jax.testing import xla_flags
from pallas_kernels.focus_importance import focus_importance_sharded
from pallas_kernels.focus_importance import reference as importance_reference
from pallas_kernels.ragged_attention import ragged_attention_sharded
from pallas_kernels.ragged_attention import reference as attention_reference

ROOT = Path(__file__).resolve().parents[1]
MESHES = ((8, 1), (2, 4), (1, 8))
IMPLS = ("xla", "pallas_tpu_interpret")
TOLERANCE = 2e-5
# Eight KV heads (so that the model axis can take all 8 devices), two query heads each.
SLOTS, BLOCK, HEADS, KV_HEADS, HEAD_DIM, LAYERS, POSITIONS = 8, 4, 16, 8, 16, 2, 32


def attention_inputs(rng: np.random.Generator, slots: int) -> dict:
    """Compacted rows of ``slots`` slots (about half of each block, padding rows after them)
    and a random cache; the first slot with every row, the last (if another) with none."""
    keep = rng.uniform(size=(slots, BLOCK)) < 0.5
    keep[-1], keep[0] = False, True
    rows, count = compact(jnp.asarray(keep.reshape(-1)))
    cache = rng.normal(size=(2, LAYERS, slots, POSITIONS, KV_HEADS, HEAD_DIM)).astype(np.float32)
    kv_len = rng.integers(1, POSITIONS + 1, size=slots)
    return {"q": rng.normal(size=(slots * BLOCK, HEADS, HEAD_DIM)).astype(np.float32),
            "rows": np.asarray(rows), "valid": np.arange(slots * BLOCK) < int(count),
            "k_cache": cache[0], "v_cache": cache[1], "layer": 1, "kv_len": kv_len}


def importance_inputs(rng: np.random.Generator, slots: int) -> dict:
    masked = rng.uniform(size=(slots, BLOCK)) < 0.6
    masked[-1], masked[0] = False, True
    return {"q": rng.normal(size=(slots, BLOCK, HEADS, HEAD_DIM)).astype(np.float32),
            "k": rng.normal(size=(slots, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float32),
            "masked": masked}


def attention_error(got, want, valid) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(want))[np.asarray(valid)].max())


def attend(mesh, impl: str, inputs: dict):
    q, rows, valid, k, v, layer, kv_len = inputs.values()
    def f(q, rows, valid, k, v, kv_len):
        return ragged_attention_sharded(mesh, q, rows, valid, k, v, layer, kv_len,
                                        block_size=BLOCK, impl=impl)

    return jax.jit(f)(q, rows, valid, k, v, kv_len)


def compare_on_mesh(data: int, model: int, impl: str) -> list[dict]:
    """Max errors of both entry points against the references on one mesh."""
    mesh = Mesh(np.array(jax.devices()[:data * model]).reshape(data, model), ("data", "model"))
    rng = np.random.default_rng(data * 10 + model)
    results = []

    inputs = attention_inputs(rng, SLOTS)
    want = attention_reference.ragged_attention(*inputs.values(), block_size=BLOCK)
    results.append({"op": "ragged_attention", "where": "every axis",
                    "error": attention_error(attend(mesh, impl, inputs), want, inputs["valid"])})

    # As the decode step calls it: each data shard compacts its own slots (rows are local).
    shards = [attention_inputs(rng, SLOTS // data) for _ in range(data)]
    stacked = {name: np.stack([s[name] for s in shards]) for name in shards[0]}
    for name in ("k_cache", "v_cache"):  # [L, S, ...]: shard i's slots are the i-th S / data
        stacked[name] = np.concatenate([s[name] for s in shards], axis=1)
    stacked["kv_len"] = np.concatenate([s["kv_len"] for s in shards])

    def per_shard(q, rows, valid, k, v, kv_len):
        return ragged_attention_sharded(mesh, q[0], rows[0], valid[0], k, v, 1, kv_len,
                                        block_size=BLOCK, impl=impl)[None]

    cache = P(None, "data")
    got = jax.jit(jax.shard_map(per_shard, mesh=mesh, axis_names={"data"},
                                in_specs=(P("data"),) * 3 + (cache, cache, P("data")),
                                out_specs=P("data")))(
        *(stacked[n] for n in ("q", "rows", "valid", "k_cache", "v_cache", "kv_len")))
    error = max(attention_error(got[i], attention_reference.ragged_attention(
        *shard.values(), block_size=BLOCK), shard["valid"]) for i, shard in enumerate(shards))
    results.append({"op": "ragged_attention", "where": "inside data", "error": error})

    inputs = importance_inputs(rng, SLOTS)
    want = importance_reference.importance(*inputs.values())
    got = jax.jit(lambda *a: focus_importance_sharded(mesh, *a, impl=impl))(*inputs.values())
    results.append({"op": "focus_importance", "where": "every axis",
                    "error": float(np.abs(np.asarray(got) - np.asarray(want)).max())})
    inner = jax.shard_map(lambda *a: focus_importance_sharded(mesh, *a, impl=impl), mesh=mesh,
                          axis_names={"data"}, in_specs=P("data"), out_specs=P("data"))
    got = jax.jit(inner)(*inputs.values())
    results.append({"op": "focus_importance", "where": "inside data",
                    "error": float(np.abs(np.asarray(got) - np.asarray(want)).max())})
    return [{"mesh": [data, model], "impl": impl, **r} for r in results]


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    for data, model in MESHES:
        for impl in IMPLS:
            for row in compare_on_mesh(data, model, impl):
                print(json.dumps(row), flush=True)


def test_sharded_entry_points_equal_the_unsharded_ops_on_8_devices():
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"),
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(tuple(r["mesh"]), r["impl"], r["op"], r["where"]) for r in rows} == {
        (mesh, impl, op, where) for mesh in MESHES for impl in IMPLS
        for op in ("ragged_attention", "focus_importance")
        for where in ("every axis", "inside data")}
    for row in rows:
        assert row["error"] <= TOLERANCE, row


def test_uneven_split_is_a_clear_error():
    mesh = jax.sharding.AbstractMesh((1, 3), ("data", "model"))
    inputs = importance_inputs(np.random.default_rng(0), 2)
    with pytest.raises(ValueError, match="KV heads = 8 does not divide by the mesh's model axis"):
        focus_importance_sharded(mesh, *inputs.values(), impl="xla")


ON_GPU = jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Triton kernels need an NVIDIA GPU and jax-triton")
def test_sharded_entry_points_with_triton_equal_the_references_on_one_gpu():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    rng = np.random.default_rng(7)
    inputs = attention_inputs(rng, SLOTS)
    want = attention_reference.ragged_attention(*inputs.values(), block_size=BLOCK)
    assert attention_error(attend(mesh, "triton", inputs), want, inputs["valid"]) <= TOLERANCE
    inputs = importance_inputs(rng, SLOTS)
    got = focus_importance_sharded(mesh, *inputs.values(), impl="triton")
    np.testing.assert_allclose(np.asarray(got),
                               np.asarray(importance_reference.importance(*inputs.values())),
                               rtol=TOLERANCE, atol=TOLERANCE)


if __name__ == "__main__":
    main()
