"""Training block-diffusion models: the objective, data sources and the optax loop."""

from focus_jax.train.data import PairSource, Prefetch, TaskSource
from focus_jax.train.objective import block_diffusion_mask, loss
from focus_jax.train.trainer import TrainConfig, train

__all__ = ["PairSource", "Prefetch", "TaskSource", "TrainConfig", "block_diffusion_mask", "loss", "train"]
