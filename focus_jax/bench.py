"""Closed-loop throughput benchmark: N requests, concurrency = batch size, three modes.

Prompt lengths are drawn (seeded) from a log-normal resembling ShareGPT first-turn prompts:
median 120 tokens, log-sd 1.0, clipped to [8, 1024] (mean about 190). Prompt tokens are drawn
uniformly from the vocabulary, avoiding special ids. Throughput counts generated tokens over the
wall time of the whole run (prompt tokens not counted), after warm-up compilation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from focus_jax.compilation import count_compilations
from focus_jax.config import NAMED_GEOMETRIES, GenerationConfig, ModelConfig, check_integer
from focus_jax.engine import Engine
from focus_jax.model import Model
from focus_jax.models.qwen3 import Decoder

PROMPT_MEDIAN, PROMPT_LOG_SD, PROMPT_MIN, PROMPT_MAX = 120, 1.0, 8, 1024


def prompt_lengths(count: int, seed: int = 0, max_len: int = PROMPT_MAX) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(math.log(PROMPT_MEDIAN), PROMPT_LOG_SD, size=count)
    return np.clip(lengths.round(), PROMPT_MIN, max_len).astype(int).tolist()


def random_prompts(cfg: ModelConfig, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, token ids uniform over the vocabulary (seeded)."""
    rng = np.random.default_rng(seed)
    low = 16  # keep clear of special ids at the start of small vocabularies
    return [rng.integers(low, min(cfg.vocab_size, 150_000), size=n).tolist() for n in lengths]


def random_model(name: str, seed: int = 0, dtype: str = "bfloat16") -> Model:
    """A named geometry (``sdar-1.7b``, ``sdar-8b``) with random weights, built on the device."""
    if name not in NAMED_GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; choose from {sorted(NAMED_GEOMETRIES)}")
    cfg = ModelConfig(**NAMED_GEOMETRIES[name], dtype=dtype)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed))))
    params = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed))))()
    return Model(cfg, graphdef, params, None, stop_token_ids=())


def layer_flops_per_token(cfg: ModelConfig) -> int:
    """Matmul FLOPs of one token through one layer (projections and MLP)."""
    e, d = cfg.hidden_size, cfg.head_dim
    return 2 * (e * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * e * cfg.intermediate_size)


def measured_bf16_peak(size: int | None = None, repeats: int = 10) -> float:
    """FLOP/s of a large bf16 matmul on the default device (random data). Default size 8192,
    1024 on CPUs (where 8192 takes over a minute and the peak is near 0.1 TFLOP/s)."""
    size = size or (1024 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a, b)
    out.block_until_ready()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


@dataclasses.dataclass
class BenchResult:
    mode: str
    batch: int
    requests: int
    generated_tokens: int
    wall_seconds: float
    steps: int
    processed_per_step: float
    retained_per_step: float
    decoded_per_step: float
    sampled_per_step: float
    """Rows through the LM head per step (the masks a step could decode)."""
    model_flops: float
    compile_seconds: float
    decode_seconds: float
    """Time in decode rounds (``step_ms`` is this per step)."""
    prefill_seconds: float
    host_seconds: float
    """Host time between decode rounds (the device idle)."""
    compilations: int
    """Programs compiled (or read from the persistent compilation cache) during the timed run,
    after warm-up: should be 0."""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds

    @property
    def step_ms(self) -> float:
        """Decode step time (prefill and host time between rounds excluded)."""
        return 1000 * self.decode_seconds / max(self.steps, 1)

    def mfu(self, peak: float) -> float:
        """Model FLOPs utilisation over the whole run (prefill and host time included)."""
        return self.model_flops / self.wall_seconds / peak

    def decode_mfu(self, peak: float) -> float:
        """Model FLOPs utilisation of the decode rounds alone."""
        return self.model_flops / self.decode_seconds / peak


def run(model: Model, modes: Sequence[str], batch: int, requests: int, max_new_tokens: int,
        seed: int = 0, block_size: int | None = None, progress: bool = False,
        mesh: Mesh | None = None, **generation: object) -> list[BenchResult]:
    """Serve ``requests`` random prompts with ``batch`` slots in each mode; greedy decoding."""
    cfg = model.config
    block = block_size or cfg.block_size or 32
    configs = [GenerationConfig(mode=mode, block_size=block, max_new_tokens=max_new_tokens,
                                stop_token_ids=(), **generation) for mode in modes]
    check_integer("batch", batch, minimum=1)
    check_integer("requests", requests, minimum=1)
    lengths = prompt_lengths(requests, seed)
    prompts = random_prompts(cfg, lengths, seed + 1)
    cache_len = max(lengths) + max_new_tokens  # the engine rounds it up to whole blocks
    return [_run_mode(model, config, batch, prompts, cache_len, progress, mesh)
            for config in configs]


def _run_mode(model: Model, config: GenerationConfig, batch: int, prompts: list[list[int]],
              cache_len: int, progress: bool, mesh: Mesh | None) -> BenchResult:
    """One mode's run. Its engine (and KV cache) is gone when this returns, before the next
    mode's engine allocates its own: two caches at once would not fit at large batch."""
    cfg = model.config
    engine = Engine(model, config, slots=batch, cache_len=cache_len, mesh=mesh)
    start = time.perf_counter()
    engine.warmup(prompt_lengths=[len(p) for p in prompts])
    compile_seconds = time.perf_counter() - start
    for prompt in prompts:
        engine.submit(prompt)
    with count_compilations() as compilations:
        engine.run(progress=progress)
    s = engine.stats
    steps = max(s.steps, 1)
    flops = layer_flops_per_token(cfg) * s.token_layers(cfg.num_layers)
    flops += 2 * cfg.hidden_size * cfg.vocab_size * s.sampled_tokens
    return BenchResult(
        mode=config.mode, batch=batch, requests=len(prompts), generated_tokens=s.generated_tokens,
        wall_seconds=s.wall_seconds, steps=s.steps,
        processed_per_step=s.processed_tokens / steps,
        retained_per_step=s.retained_tokens / steps, decoded_per_step=s.decoded_tokens / steps,
        sampled_per_step=s.sampled_tokens / steps,
        model_flops=flops, compile_seconds=compile_seconds, decode_seconds=s.decode_seconds,
        prefill_seconds=s.prefill_seconds, host_seconds=s.host_seconds,
        compilations=compilations.programs)
