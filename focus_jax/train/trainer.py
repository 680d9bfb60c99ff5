"""The training loop: optax AdamW, float32 master weights with bfloat16 compute, orbax
checkpoints with resume, a JSON-lines loss log and a progress bar."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from focus_jax import checkpoint
from focus_jax.config import SUPPORTED_BLOCK_SIZES, ConfigError
from focus_jax.model import Model
from focus_jax.train import run
from focus_jax.train.data import BatchSource
from focus_jax.train.objective import loss

# Options that say when to log, save or stop, not what the weights become: a run resumes with
# other values of these.
_SCHEDULING = ("log_every", "checkpoint_every", "checkpoint_seconds", "max_seconds")


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
    checkpoint_every: int | None = None
    """Save a checkpoint every this many steps (and see ``checkpoint_seconds``)."""
    checkpoint_seconds: float | None = 180.0
    """Save a checkpoint once this much wall time has passed since the last one. Checkpoints
    are also saved at the end, when ``max_seconds`` runs out, and on Ctrl-C."""
    max_seconds: float | None = None
    """Stop early (and save) once this much wall time has passed."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup_steps < 0 or not self.learning_rate > 0:
            raise ConfigError("steps >= 1, warmup_steps >= 0 and learning_rate > 0 are required")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ConfigError("compute_dtype must be 'bfloat16' or 'float32'")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"block_size {self.block_size} is not supported; supported: "
                              f"{SUPPORTED_BLOCK_SIZES}")
        for name in ("truncate_prob", "stale_prob", "delayed_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("log_every", "checkpoint_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_seconds is not None and not self.checkpoint_seconds > 0:
            raise ConfigError(f"checkpoint_seconds must be > 0, got {self.checkpoint_seconds}")

    def trajectory(self) -> dict[str, Any]:
        """The options that determine the weights (all but when to log, save and stop)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name not in _SCHEDULING}


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with warm-up and cosine decay. The same object for the same settings: it is a
    static argument of the compiled step, so a second run in the process compiles nothing."""
    return _optimizer(cfg.learning_rate, cfg.warmup_steps, cfg.steps, cfg.grad_clip,
                      cfg.weight_decay)


@functools.cache
def _optimizer(learning_rate: float, warmup_steps: int, steps: int, grad_clip: float,
               weight_decay: float) -> optax.GradientTransformation:
    # optax needs at least one step of warm-up and one of decay (a one-step run included).
    warmup = max(warmup_steps, 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, max(steps, warmup + 1), end_value=learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, b2=0.98, weight_decay=weight_decay))


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
    # Committed to the device as the step's outputs are, so that the first step compiles the
    # program the later ones run (a loaded model's weights are committed, a new model's not).
    device = jax.devices()[0]
    return step, jax.device_put(params, device), jax.device_put(tx.init(params), device)


def train(model: Model, source: BatchSource, cfg: TrainConfig, out_dir: str | Path, *,
          overwrite: bool = False, progress: bool = True) -> Model:
    """Train ``model`` on ``source``; checkpoints (and ``log.jsonl``) go to ``out_dir``, the
    final model to ``out_dir/model`` (a converted folder, in the model's dtype, whose config
    says ``cfg.block_size``).

    ``out_dir`` holds one run (``run.json``: ``cfg.trajectory()``, the source's identity, the
    initial model's config and a hash of its weights). A folder of the same run resumes from
    its latest checkpoint, to the same weights as an uninterrupted run; a folder of another
    run is a ``ConfigError`` naming the difference, unless ``overwrite`` (start over). On
    Ctrl-C the step in flight finishes, a checkpoint is saved, then ``KeyboardInterrupt``.
    """
    out = Path(out_dir).expanduser().resolve()
    run.prepare(out, {**cfg.trajectory(), **source.identity(),
                      "model_config": model.config.to_hf_dict(),
                      "model_weights": run.weights_digest(model.params)}, overwrite)
    train_step, params, opt_state = step_and_state(model, cfg)
    manager = ocp.CheckpointManager(out / run.STATE_DIR,
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = manager.latest_step() or 0
    if start:
        target = {"params": params, "opt_state": opt_state}
        restored = manager.restore(start, args=ocp.args.StandardRestore(target))
        params, opt_state = restored["params"], restored["opt_state"]
        if progress:
            print(f"resuming {out} at step {start} of {cfg.steps}", file=sys.stderr)
    run.keep_log_until(out / run.LOG_FILE, start)

    base_key = jax.random.key(cfg.seed)
    began = saved = time.perf_counter()
    step = start
    waited = 0.0  # seconds spent getting batches since the last log record
    with (open(out / run.LOG_FILE, "a") as log, _deferred_interrupt() as interrupted,
          tqdm(total=cfg.steps, initial=start, disable=not progress, desc="train") as bar):
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
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                acc=f"{record['masked_accuracy']:.3f}")
            now = time.perf_counter()
            out_of_time = cfg.max_seconds is not None and now - began > cfg.max_seconds
            stop = interrupted()  # read once: a Ctrl-C from here on waits for the next step
            if (step == cfg.steps or out_of_time or stop
                    or (cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0)
                    or (cfg.checkpoint_seconds is not None and now - saved >= cfg.checkpoint_seconds)):
                manager.save(step, args=ocp.args.StandardSave({"params": params,
                                                               "opt_state": opt_state}))
                saved = now
            if stop:
                manager.wait_until_finished()
                raise KeyboardInterrupt(f"interrupted at step {step} of {cfg.steps}; the "
                                        f"checkpoint is saved in {out}: the same command resumes")
            if out_of_time:
                break
    manager.wait_until_finished()
    dtype = model.config.jnp_dtype
    state = nnx.clone(model.params)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda p: p.astype(dtype), params))
    trained = dataclasses.replace(model, config=model.config.replace(block_size=cfg.block_size),
                                  params=state)
    checkpoint.save(trained, out / run.MODEL_DIR, overwrite=True)
    return trained


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Ctrl-C (SIGINT) only raises a flag that the loop reads after each step (a second Ctrl-C
    interrupts at once): the step donates its inputs, so the parameters are whole only between
    steps. Signals reach the main thread alone; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    caught: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(caught)
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
