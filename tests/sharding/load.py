"""Run in a fresh process with 8 forced CPU devices: a Hugging Face folder read onto a mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/load.py HF CONVERTED
Prints one JSON line per mesh and parameter, as ``models.weights.load_safetensors`` returns it
(the reader of host tensors): whether it equals the single-device load, whether it carries its
parameter's sharding, and the shape of each device's shard; then one line per mesh and folder
for ``focus_jax.load`` (the Hugging Face folder ``HF``, and ``CONVERTED``, the same weights
converted).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import numpy as np
from flax import nnx

import focus_jax
from focus_jax.config import ModelConfig
from focus_jax.models.weights import load_safetensors
from focus_jax.sharding import make_mesh, param_shardings


def flat(params: nnx.State) -> dict[tuple[str, ...], jax.Array]:
    return {path: var.get_value() for path, var in nnx.to_flat_state(params)}


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    folder = Path(sys.argv[1])
    cfg = ModelConfig.from_file(folder / "config.json")
    whole = flat(nnx.state(load_safetensors(folder, cfg)))
    for data, model in ((2, 4), (1, 8), (8, 1)):
        mesh = make_mesh(data, model)
        params = nnx.state(load_safetensors(folder, cfg, mesh))
        wanted = dict(nnx.to_flat_state(param_shardings(params, mesh)))
        for path, value in flat(params).items():
            print(json.dumps({
                "mesh": [data, model], "param": ".".join(path),
                "equal": bool(np.array_equal(np.asarray(value), np.asarray(whole[path]))),
                "sharding": value.sharding == wanted[path],
                "sharded": not value.sharding.is_fully_replicated,
                "shard_shapes": sorted({tuple(s.data.shape) for s in value.addressable_shards}),
                "shape": list(value.shape)}), flush=True)
        for source in sys.argv[1:]:
            loaded = flat(focus_jax.load(source, tokenizer=False, mesh=mesh).params)
            print(json.dumps({"mesh": [data, model], "load": all(
                loaded[p].sharding == wanted[p] and np.array_equal(loaded[p], whole[p])
                for p in whole)}), flush=True)


if __name__ == "__main__":
    main()
