"""One of two processes on localhost (CPU, gloo): decode over a mesh spanning both.

    python tests/sharding/multiprocess.py PORT PROCESS_ID MODE
Process 0 prints the tokens as one JSON line; with PROCESS_ID "single" it runs alone, unsharded.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax

jax.config.update("jax_default_matmul_precision", "highest")

from focus_jax import GenerationConfig, distributed, generate  # noqa: E402
from focus_jax.sharding import make_mesh  # noqa: E402
from focus_jax.testing import random_prompts, tiny_model  # noqa: E402


def main() -> None:
    port, process, mode = sys.argv[1:4]
    mesh = None
    if process != "single":
        distributed.initialize(f"127.0.0.1:{port}", 2, int(process))
        mesh = make_mesh(data=2, model=1)
    tokens = decode(mode, mesh)
    if distributed.is_primary():
        print(json.dumps(tokens), flush=True)


def decode(mode: str, mesh=None) -> list[list[int]]:
    """The tokens of the tiny model's prompts (the test computes the unsharded ones itself)."""
    model = tiny_model(seed=0, scale=4.0)
    prompts = random_prompts(4, 128, 2, 14, seed=41)
    # Two compaction buckets: a round still switches between them, and compiles half the
    # branches of the CPU's four.
    config = GenerationConfig(mode=mode, block_size=4, threshold=0.04, alpha=1.0,
                              max_new_tokens=8, stop_token_ids=(), max_batch=4,
                              bucket_ladder=(0.5, 1.0))
    return [r.token_ids for r in generate(model, prompts, config, mesh=mesh)]


if __name__ == "__main__":
    main()
