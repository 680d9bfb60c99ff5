"""Train the bundled model: tokenizer, geometry and training run, then export and evaluate.

The bundled checkpoints/focus-tiny came from two runs of this script on one H200 (2026-12-01),
on the worked suite: run f from scratch, then run h from f's weights rounded to bfloat16, with
the delayed cache's views (the exact command lines, and the one-line rounding step between them,
are in docs/quality.md):

    T=worked_copy,worked_reverse,worked_sort,worked_recall,worked_add,story
    python scripts/train_bundled.py --out /tmp/f --block-size 32 --seq-len 160 --batch-size 256 \
      --learning-rate 1.5e-3 --task-per-batch --steps 5889 --max-seconds 395 \
      --truncate-prob 0.25 --stale-prob 0.8 --tasks $T --export-dtype float32
    python scripts/train_bundled.py --out /tmp/h --init /tmp/f16 --block-size 32 --seq-len 160 \
      --batch-size 256 --learning-rate 1e-3 --task-per-batch --steps 5500 --max-seconds 335 \
      --truncate-prob 0.25 --delayed-prob 0.8 --tasks $T --eval-per-task 100 \
      --eval-max-new-tokens 128

The result folder is a Hugging Face style folder (config.json, safetensors shards of <= 15 MB,
tokenizer files) that `focus_jax.load` reads; checkpoints/focus-tiny is a copy of /tmp/h's.
The earlier runs and their commands are in docs/quality.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
from pathlib import Path

from flax import nnx

import focus_jax
from focus_jax import evaluate, tasks
from focus_jax.checkpoint import replacing
from focus_jax.config import ConfigError, ModelConfig
from focus_jax.model import Model
from focus_jax.models.decoder import Decoder
from focus_jax.models.weights import save_safetensors
from focus_jax.train import Prefetch, TaskSource, TrainConfig, train
from focus_jax.train.tokenizer import train_bpe


def build_tokenizer(task_names: tuple[str, ...] = tasks.SUITE, vocab_size: int = 512):
    texts = []
    for example in itertools.islice(tasks.training_stream(0, task_names), 60_000):
        texts += [example.question, example.answer]
    return train_bpe(texts, vocab_size)


def geometry(tokenizer, block_size: int, **overrides) -> ModelConfig:
    vocab = -(-len(tokenizer) // 64) * 64
    fields = dict(vocab_size=vocab, hidden_size=384, intermediate_size=1024, num_layers=8,
                  num_heads=6, num_kv_heads=2, head_dim=64, rope_theta=10_000.0,
                  max_position_embeddings=1024, tie_word_embeddings=True, block_size=block_size,
                  mask_token_id=tokenizer.mask_token_id, model_type="qwen3", dtype="float32")
    fields.update(overrides)
    return ModelConfig(**fields)


def export(model: Model, folder: Path, dtype: str = "bfloat16") -> None:
    """A Hugging Face style folder in ``dtype``: config, safetensors shards, tokenizer (whole or
    not at all: an old folder there is replaced once the new one is complete)."""
    config = model.config.replace(dtype=dtype)
    graphdef, state = nnx.split(model.module())
    state = nnx.map_state(lambda _, v: v.astype(dtype), state)
    with replacing(folder, overwrite=True) as staging:
        save_safetensors(nnx.merge(graphdef, state), staging)
        (staging / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
        model.tokenizer.save_pretrained(str(staging))
        (staging / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": model.tokenizer.eos_token_id, "mask_token_id": config.mask_token_id}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--max-seconds", type=float, default=None)
    parser.add_argument("--eval-per-task", type=int, default=50)
    parser.add_argument("--eval-max-new-tokens", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--tasks", default=",".join(tasks.SUITE))
    parser.add_argument("--truncate-prob", type=float, default=0.0,
                        help="share of blocks trained with a truncated in-block view (FOCUS)")
    parser.add_argument("--stale-prob", type=float, default=0.0,
                        help="share of blocks trained with the delayed KV cache's stale views")
    parser.add_argument("--delayed-prob", type=float, default=0.0,
                        help="share of sequences trained with the delayed KV cache's views, "
                             "the history's included")
    parser.add_argument("--task-per-batch", action="store_true",
                        help="one task per batch, trimmed to its longest pair (less padding)")
    parser.add_argument("--small", action="store_true", help="a tiny geometry for smoke tests")
    parser.add_argument("--init", type=Path, default=None,
                        help="continue from this model folder (its weights, geometry and "
                             "tokenizer) with a fresh optimizer, instead of a new model")
    parser.add_argument("--workers", type=int, default=min(8, (os.cpu_count() or 1) // 2),
                        help="processes generating batches ahead (0: in the training process)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the training stream and of the noise (held-out questions "
                             "are never trained on, whatever the seed)")
    parser.add_argument("--export-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="float32 keeps full precision for a later --init")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an --out whose run had other options (else it "
                             "resumes the same run, or refuses another)")
    args = parser.parse_args()

    task_names = tuple(args.tasks.split(","))
    if args.init:
        model = focus_jax.load(args.init)
        if model.config.block_size != args.block_size:
            parser.error(f"--block-size {args.block_size} differs from {args.init}'s "
                         f"{model.config.block_size}")
    else:
        tokenizer = build_tokenizer(task_names)
        overrides = dict(hidden_size=64, intermediate_size=128, num_layers=3, num_heads=2,
                         head_dim=32) if args.small else {}
        cfg = geometry(tokenizer, args.block_size, **{"num_layers": args.num_layers, **overrides})
        model = Model.from_decoder(Decoder(cfg, rngs=nnx.Rngs(0)), tokenizer,
                                   (tokenizer.eos_token_id,))
    print(f"parameters: {model.config.num_params / 1e6:.2f}M, vocab {model.config.vocab_size}")
    source = TaskSource(model, args.batch_size, args.seq_len, seed=args.seed, task_names=task_names,
                        trim_multiple=args.block_size if args.task_per_batch else None)
    train_cfg = TrainConfig(steps=args.steps, learning_rate=args.learning_rate,
                            warmup_steps=min(200, args.steps // 10), block_size=args.block_size,
                            max_seconds=args.max_seconds, checkpoint_every=1000, log_every=100,
                            truncate_prob=args.truncate_prob, stale_prob=args.stale_prob,
                            delayed_prob=args.delayed_prob, seed=args.seed)
    with contextlib.ExitStack() as stack:
        if args.workers:
            source = stack.enter_context(Prefetch(source, args.workers))
        try:
            trained = train(model, source, train_cfg, args.out / "run", overwrite=args.overwrite)
        except ConfigError as err:  # another run in --out
            parser.error(str(err))
    export(trained, args.out / "focus-tiny", args.export_dtype)
    if args.eval_per_task:
        reports = evaluate.evaluate(trained, tasks.held_out(args.eval_per_task, tasks=task_names),
                                    max_batch=128, max_new_tokens=args.eval_max_new_tokens)
        table = evaluate.markdown(reports)
        print(table)
        (args.out / "eval.md").write_text(table + "\n")
        (args.out / "eval.json").write_text(json.dumps([r.summary() for r in reports], indent=1))


if __name__ == "__main__":
    main()
