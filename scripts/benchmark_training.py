"""Training throughput of the worked-suite models' geometry on one accelerator (docs/training.md).

    python scripts/benchmark_training.py --batches 128,256,512 --length 128 --json out.json

For each batch size: the median seconds of one jit-compiled training step (with the worked-suite
runs' truncated and stale views) over ``--steps`` steps after a warm-up, on random tokens of
which the second half of each row is trainable, and the sequences per second that makes. Then
the seconds the host takes to build one batch of worked answers (``TaskSource.batch``), the work
that ``Prefetch`` moves to other processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from train_bundled import build_tokenizer, geometry  # scripts/

from focus_jax import tasks
from focus_jax.model import Model
from focus_jax.models.decoder import Decoder
from focus_jax.train import TaskSource, TrainConfig
from focus_jax.train.trainer import step_and_state


def step_seconds(model: Model, batch: int, length: int, steps: int, block_size: int) -> float:
    cfg = TrainConfig(steps=1000, block_size=block_size, truncate_prob=0.25, stale_prob=0.8)
    train_step, params, opt_state = step_and_state(model, cfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(10, model.config.vocab_size, (batch, length)), jnp.int32)
    trainable = jnp.asarray(np.arange(length)[None, :] >= length // 2).repeat(batch, 0)
    times = []
    for step in range(steps + 3):  # three warm-up steps (the first compiles)
        start = time.perf_counter()
        params, opt_state, metrics = train_step(params, opt_state, tokens, trainable,
                                                jax.random.key(step))
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="128,256,512")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    tokenizer = build_tokenizer(tasks.WORKED)
    model = Model.from_decoder(Decoder(geometry(tokenizer, args.block_size), rngs=nnx.Rngs(0)),
                               tokenizer, (tokenizer.eos_token_id,))
    rows = []
    for batch in map(int, args.batches.split(",")):
        seconds = step_seconds(model, batch, args.length, args.steps, args.block_size)
        source = TaskSource(model, batch, 160, task_names=tasks.WORKED,
                            trim_multiple=args.block_size)
        start = time.perf_counter()
        for index in range(12):
            source.batch(index)
        host = (time.perf_counter() - start) / 12
        rows.append({"batch": batch, "length": args.length, "step_seconds": seconds,
                     "sequences_per_second": batch / seconds, "host_batch_seconds": host})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
