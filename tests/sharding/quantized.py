"""Run in a fresh process with 4 forced CPU devices: an int8 mixture's logits on meshes that
split its experts and their width equal the logits on one device.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/sharding/quantized.py
Prints one JSON line per mesh: the largest difference from the single-device logits, and
whether every 8-bit weight and scale carries its parameter's sharding.
"""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focus_jax import quant
from focus_jax.models.decoder import forward
from focus_jax.sharding import make_mesh, param_shardings, shard_params
from focus_jax.testing import random_prompts
from tests.test_moe_decoding import llada2_model


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    jax.config.update("jax_default_matmul_precision", "highest")
    model = quant.quantize(llada2_model(), "int8")
    tokens = jnp.asarray(random_prompts(2, 128, 16, 16, seed=3), jnp.int32)

    def logits(params, mesh):
        return forward(nnx.merge(model.graphdef, params), tokens, 4, mesh=mesh)[0]

    want = np.asarray(jax.jit(lambda p: logits(p, None))(model.params))
    for data, expert, width in ((1, 2, 2), (1, 4, 1), (2, 1, 2)):
        mesh = make_mesh(data, width, expert=expert)
        params = shard_params(model.params, mesh)
        placed = all(var.get_value().sharding == where for (_, var), (_, where) in
                     zip(nnx.to_flat_state(params),
                         nnx.to_flat_state(param_shardings(params, mesh)), strict=True))
        got = np.asarray(jax.jit(lambda p, mesh=mesh: logits(p, mesh))(params))
        print(json.dumps({"mesh": [data, expert, width], "placed": placed,
                          "max_difference": float(np.abs(got - want).max())}))


if __name__ == "__main__":
    main()
