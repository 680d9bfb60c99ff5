"""The training loop: optax AdamW, float32 master weights with bfloat16 compute, orbax
checkpoints with resume, a JSON-lines loss log and a progress bar."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from focus_jax import checkpoint
from focus_jax.model import Model
from focus_jax.train.data import BatchSource
from focus_jax.train.objective import loss


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    block_size: int = 8
    compute_dtype: str = "bfloat16"
    truncate_prob: float = 0.0
    """Probability of a truncated in-block view per block (see ``objective``)."""
    stale_prob: float = 0.0
    """Probability of a block trained with the delayed KV cache's stale views (``objective``)."""
    delayed_prob: float = 0.0
    """Probability of a sequence trained with the delayed KV cache's views, the history's
    included (``objective``)."""
    seed: int = 0
    log_every: int = 50
    checkpoint_every: int = 500
    max_seconds: float | None = None
    """Stop early (and save) once this much wall time has passed."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup_steps < 0 or self.learning_rate <= 0:
            raise ValueError("steps >= 1, warmup_steps >= 0 and learning_rate > 0 are required")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ValueError("compute_dtype must be 'bfloat16' or 'float32'")
        for name in ("truncate_prob", "stale_prob", "delayed_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, b2=0.98, weight_decay=cfg.weight_decay))


@dataclasses.dataclass(frozen=True)
class _LossOptions:
    """What the compiled step needs of the model and the config besides the weights (static)."""
    block_size: int
    mask_token_id: int
    compute_dtype: str
    truncate_prob: float
    stale_prob: float
    delayed_prob: float


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def _train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, options: _LossOptions,
                params: Any, opt_state: Any, tokens: jax.Array, trainable: jax.Array,
                key: jax.Array):
    def objective(params):
        cast = jax.tree.map(lambda p: p.astype(options.compute_dtype), params)
        return loss(nnx.merge(graphdef, cast), tokens, trainable, key, options.block_size,
                    options.mask_token_id, truncate_prob=options.truncate_prob,
                    stale_prob=options.stale_prob, delayed_prob=options.delayed_prob)

    (value, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": value, "grad_norm": optax.tree.norm(grads), **metrics}


def step_and_state(model: Model, cfg: TrainConfig) -> tuple[Callable[..., Any], Any, Any]:
    """``(step, params, opt_state)``: the compiled training step as a function of ``(params,
    opt_state, tokens, trainable, key)`` returning ``(params, opt_state, metrics)``, and the
    initial float32 copy of the model's parameters (the step donates, so the model keeps its
    own) with its optimizer state."""
    tx = optimizer(cfg)
    params = jax.tree.map(lambda p: jnp.array(p, jnp.float32), nnx.to_pure_dict(model.params))
    options = _LossOptions(cfg.block_size, model.mask_token_id, cfg.compute_dtype,
                           cfg.truncate_prob, cfg.stale_prob, cfg.delayed_prob)
    step = functools.partial(_train_step, model.graphdef, tx, options)
    return step, params, tx.init(params)


def train(model: Model, source: BatchSource, cfg: TrainConfig, out_dir: str | Path, *,
          resume: bool = True, progress: bool = True) -> Model:
    """Train ``model`` on ``source``; checkpoints (and ``log.jsonl``) go to ``out_dir``, the
    final model to ``out_dir/model`` (a converted folder, in the model's dtype).

    With ``resume``, training continues from the latest checkpoint in ``out_dir``.
    """
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    train_step, params, opt_state = step_and_state(model, cfg)
    manager = ocp.CheckpointManager(out / "train_state",
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if resume and manager.latest_step() is not None:
        start = manager.latest_step()
        target = {"params": params, "opt_state": opt_state}
        restored = manager.restore(start, args=ocp.args.StandardRestore(target))
        params, opt_state = restored["params"], restored["opt_state"]

    base_key = jax.random.key(cfg.seed)
    log = (out / "log.jsonl").open("a")
    began = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=start, disable=not progress, desc="train")
    step = start
    waited = 0.0  # seconds spent getting batches since the last log record
    while step < cfg.steps:
        asked = time.perf_counter()
        tokens, trainable = source.batch(step)
        waited += time.perf_counter() - asked
        params, opt_state, metrics = train_step(params, opt_state, tokens, trainable,
                                                jax.random.fold_in(base_key, step))
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            record = {"step": step, **{k: float(v) for k, v in metrics.items()},
                      "seconds": round(time.perf_counter() - began, 2),
                      "data_seconds": round(waited, 3)}
            waited = 0.0
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['masked_accuracy']:.3f}")
        out_of_time = cfg.max_seconds is not None and time.perf_counter() - began > cfg.max_seconds
        if step % cfg.checkpoint_every == 0 or step == cfg.steps or out_of_time:
            manager.save(step, args=ocp.args.StandardSave({"params": params,
                                                           "opt_state": opt_state}))
        if out_of_time:
            break
    manager.wait_until_finished()
    bar.close()
    log.close()
    dtype = model.config.jnp_dtype
    state = nnx.clone(model.params)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda p: p.astype(dtype), params))
    trained = dataclasses.replace(model, params=state)
    checkpoint.save(trained, out / "model")
    return trained
