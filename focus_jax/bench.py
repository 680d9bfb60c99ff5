"""Closed-loop throughput benchmark: N requests, concurrency = batch size, three modes.

Prompt lengths are drawn (seeded) from a log-normal resembling ShareGPT first-turn prompts:
median 120 tokens, log-sd 1.0, clipped to [8, 1024] (mean about 190). Prompt tokens are drawn
uniformly from the vocabulary, avoiding special ids. Throughput counts generated tokens over the
wall time of the whole run (prompt tokens not counted), after warm-up compilation.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from focus_jax import compilation
from focus_jax.compilation import count_compilations
from focus_jax.config import GenerationConfig, ModelConfig, Quantization, check_integer
from focus_jax.engine import Engine, SamplingParams, run_to_completion
from focus_jax.model import Model
from focus_jax.models import geometry
from focus_jax.models.decoder import Decoder
from focus_jax.quant import check_platform

PROMPT_MEDIAN, PROMPT_LOG_SD, PROMPT_MIN, PROMPT_MAX = 120, 1.0, 8, 1024


def prompt_lengths(count: int, seed: int = 0, max_len: int = PROMPT_MAX,
                   long: tuple[float, int, int] | None = None) -> list[int]:
    """``count`` seeded prompt lengths (the module's distribution). ``long = (fraction, low,
    high)``: that fraction of the requests (seeded, rounded to whole requests) instead get
    lengths uniform in ``[low, high]`` (mixed lengths: a few long documents among chat
    prompts)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(math.log(PROMPT_MEDIAN), PROMPT_LOG_SD, size=count)
    lengths = np.clip(lengths.round(), PROMPT_MIN, max_len).astype(int)
    if long is not None:
        fraction, low, high = long
        chosen = np.random.default_rng(seed + 3).choice(count, round(fraction * count),
                                                        replace=False)
        lengths[chosen] = np.random.default_rng(seed + 4).integers(low, high + 1, len(chosen))
    return lengths.tolist()


def random_prompts(cfg: ModelConfig, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, token ids uniform over the vocabulary (seeded)."""
    rng = np.random.default_rng(seed)
    low = 16  # keep clear of special ids at the start of small vocabularies
    return [rng.integers(low, min(cfg.vocab_size, 150_000), size=n).tolist() for n in lengths]


def random_model(name: str, seed: int = 0, dtype: str = "bfloat16",
                 quantization: Quantization | None = None, abstract: bool = False) -> Model:
    """A named geometry (``sdar-1.7b``, ``sdar-8b``) with random weights, built on the device
    (with ``quantization``: its 8-bit weights only, quantized as they are drawn). ``abstract``:
    the weights' shapes only, no device memory: an engine of it compiles its programs (into
    the persistent compilation cache) and runs nothing (``bench --compile-only``); the program
    that draws the weights is compiled too, for the process that will draw them."""
    check_platform(quantization, jax.default_backend())
    cfg = geometry(name, dtype).replace(quantization=quantization)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed))))
    draw = jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed))))
    if abstract:
        draw.lower().compile()
        params = jax.eval_shape(draw)
    else:
        params = draw()
    return Model(cfg, graphdef, params, None, stop_token_ids=())


def add_light_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The light-load setting's command-line options (:func:`light_load`), for the scripts
    that measure it: ``--geometry``, ``--batch`` (slots), ``--requests``, ``--cache-len`` and
    ``--kernels``."""
    parser.add_argument("--geometry", default="sdar-8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--cache-len", type=int, default=1536)
    parser.add_argument("--kernels", default=None)


def light_load(geometry: str, slots: int, requests: int, cache_len: int,
               **generation) -> tuple[Engine, list[list[int]]]:
    """A lightly loaded engine's setting: a random ``geometry`` model in an engine of ``slots``
    slots, warmed up for ``requests`` random prompts (returned, not started); ``generation``:
    more :class:`GenerationConfig` fields."""
    model = random_model(geometry)
    prompts = random_prompts(model.config, prompt_lengths(requests), seed=1)
    config = GenerationConfig(block_size=model.config.block_size or 32, stop_token_ids=(),
                              **generation)
    engine = Engine(model, config, slots=slots, cache_len=cache_len)
    engine.warmup([len(p) for p in prompts])  # the prefill programs they need, not every bucket
    return engine, prompts


def start_long_requests(engine: Engine, prompts: Sequence[Sequence[int]]) -> list[int]:
    """Start ``prompts`` with as many new tokens as the cache holds (less a block's margin), so
    that none ends during a measurement; a first step admits and prefills them. Their ids."""
    budget = engine.cache_len - max(len(p) for p in prompts) - 32
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=budget)) for p in prompts]
    engine.step()
    return ids


def layer_flops_per_token(cfg: ModelConfig) -> float:
    """Matmul FLOPs of one token through one layer (projections and feed-forward: the MLP, or
    the router, the chosen experts and the shared expert), averaged over the layers: the active
    parameters' FLOPs."""
    return 2 * (cfg.attention_params + cfg.feed_forward_params(active=True) / cfg.num_layers)


def measured_bf16_peak(size: int | None = None, repeats: int = 10) -> float:
    """FLOP/s of a large bf16 matmul on the default device (random data). Default size 8192,
    1024 on CPUs (where 8192 takes over a minute and the peak is near 0.1 TFLOP/s)."""
    size = _peak_size(size)
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    return _matmul_rate(lambda x, y: x @ y, a, b, repeats)


def measured_8bit_peak(weights: str, size: int | None = None, repeats: int = 10) -> float:
    """FLOP/s of a large 8-bit x 8-bit matmul on the default device: ``weights`` "fp8" (e4m3
    operands, bf16 output: cuBLASLt's FP8 GEMM on Hopper) or "int8" (int32 output). The right
    operand is stored ``[N, K]`` (contracted on its last axis), the layout of those GEMMs, as a
    quantized round's products with 8-bit activations run them. Sizes as
    :func:`measured_bf16_peak`'s."""
    size = _peak_size(size)
    dtype, out = {"fp8": (jnp.float8_e4m3fn, jnp.bfloat16), "int8": (jnp.int8, jnp.int32)}[weights]

    def operand(seed: int) -> jax.Array:
        x = 16 * jax.random.normal(jax.random.key(seed), (size, size), jnp.float32)
        return (jnp.clip(jnp.round(x), -127, 127) if weights == "int8" else x).astype(dtype)

    return _matmul_rate(lambda x, y: jax.lax.dot_general(
        x, y, (((1,), (1,)), ((), ())), preferred_element_type=out), operand(0), operand(1), repeats)


def _peak_size(size: int | None) -> int:
    return size or (1024 if jax.default_backend() == "cpu" else 8192)


def _matmul_rate(matmul: Callable, a: jax.Array, b: jax.Array, repeats: int) -> float:
    """FLOP/s of ``matmul(a, b)`` (square operands), jitted, after its compile and a first run."""
    matmul = jax.jit(matmul)
    matmul(a, b).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        result = matmul(a, b)
    result.block_until_ready()
    return 2 * a.shape[0] ** 3 * repeats / (time.perf_counter() - start)


def median_seconds(fn: Callable[..., Any], *args: Any, runs: int, warmup: int = 0) -> float:
    """Median wall time of ``runs`` calls of ``fn(*args)``, each waited for
    (``jax.block_until_ready``), after a first call (the compile) and ``warmup`` more."""
    for _ in range(1 + warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Throughput:
    """Output tokens per second and decode step time of a run's ``generated_tokens``,
    ``wall_seconds``, ``steps`` and ``decode_seconds``."""

    generated_tokens: int
    wall_seconds: float
    steps: int
    decode_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds

    @property
    def step_ms(self) -> float:
        """Decode step time (prefill and host time between rounds excluded)."""
        return 1000 * self.decode_seconds / max(self.steps, 1)


@dataclasses.dataclass
class BenchResult(_Throughput):
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
    warmup_compiled: int = 0
    """Programs the warm-up compiled afresh."""
    warmup_loaded: int = 0
    """Programs the warm-up read from the persistent compilation cache."""
    kv_cache: str = "contiguous"
    kv_pages: int = 0
    """Pages of a paged cache's pool (0: contiguous)."""
    kv_pages_peak: int = 0
    """The most pages requests held at once."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    prefix_hit_rate: float = 0.0

    def mfu(self, peak: float) -> float:
        """Model FLOPs utilisation over the whole run (prefill and host time included)."""
        return self.model_flops / self.wall_seconds / peak

    def decode_mfu(self, peak: float) -> float:
        """Model FLOPs utilisation of the decode rounds alone."""
        return self.model_flops / self.decode_seconds / peak


def compile_runs(model: Model, modes: Sequence[str], batches: Sequence[int],
                 requests_per_slot: int, max_new_tokens: int, seed: int = 0,
                 long_prompts: tuple[float, int, int] | None = None,
                 max_model_len: int | None = None, workers: int | None = None,
                 block_size: int | None = None, requests: int | None = None,
                 **generation: object) -> float:
    """Compile the programs of every run that :func:`run` makes for each of ``batches`` (with
    ``requests`` requests, default ``batch * requests_per_slot``) in each mode, all at once,
    ``workers`` at a time (default: one per two cores, at most 12), for the weights' shapes only
    (no device memory beyond the weights already held). The runs then compile nothing: one
    process's compiles overlap, and each run's timing is its own. The seconds it took."""
    start = time.perf_counter()
    engines = []
    for batch in batches:
        configs, prompts, cache_len = _plan(model, modes, batch,
                                            requests or batch * requests_per_slot,
                                            max_new_tokens, seed, block_size, long_prompts,
                                            max_model_len, generation)
        engines += [(config, batch, cache_len, [len(p) for p in prompts]) for config in configs]
    compile_engines(model, engines, workers or max(1, min(12, compilation.CORES // 2)))
    return time.perf_counter() - start


def compile_engines(model: Model, engines: Sequence[tuple[GenerationConfig, int, int, Sequence[int]]],
                    workers: int | None = None) -> None:
    """Compile the programs of engines ``(config, slots, cache_len, prompt lengths)`` of
    ``model`` for its weights' shapes only (no device memory beyond the weights already held),
    ``workers`` at a time: engines made afterwards with those arguments compile nothing."""
    shapes = dataclasses.replace(model, params=jax.tree.map(compilation.shape_of, model.params))
    # Each engine keeps at most four jitted programs (its state's, the round, two prefills):
    # all must stay for the engines made later, which then find them compiled.
    compilation.PROGRAMS.capacity = max(compilation.PROGRAMS.capacity, 4 * len(engines))
    rounds, prefills = [], []
    for config, slots, cache_len, lengths in engines:
        engine = Engine(shapes, config, slots=slots, cache_len=cache_len, detokenize=False)
        first, *rest = engine.runner.programs(lengths, prefix=config.prefix_caching)
        rounds.append(first)  # the longest compiles first
        prefills += rest
    compilation.compile_together(rounds + prefills, workers)


def _plan(model: Model, modes: Sequence[str], batch: int, requests: int, max_new_tokens: int,
          seed: int, block_size: int | None, long_prompts: tuple[float, int, int] | None,
          max_model_len: int | None, generation: dict
          ) -> tuple[list[GenerationConfig], list[list[int]], int]:
    """A run's configs (one per mode), prompts and cache length (:func:`run`)."""
    cfg = model.config
    block = block_size or cfg.block_size or 32
    configs = [GenerationConfig(mode=mode, block_size=block, max_new_tokens=max_new_tokens,
                                stop_token_ids=(), **generation) for mode in modes]
    check_integer("batch", batch, minimum=1)
    check_integer("requests", requests, minimum=1)
    lengths = prompt_lengths(requests, seed, long=long_prompts)
    prompts = random_prompts(cfg, lengths, seed + 1)
    # The engine rounds it up to whole blocks.
    return configs, prompts, max_model_len or max(lengths) + max_new_tokens


def run(model: Model, modes: Sequence[str], batch: int, requests: int, max_new_tokens: int,
        seed: int = 0, block_size: int | None = None, progress: bool = False,
        mesh: Mesh | None = None, long_prompts: tuple[float, int, int] | None = None,
        max_model_len: int | None = None, compile_only: bool = False,
        **generation: object) -> list[BenchResult]:
    """Serve ``requests`` random prompts with ``batch`` slots in each mode; greedy decoding.
    ``long_prompts``: a fraction of long prompts (:func:`prompt_lengths`); ``max_model_len``:
    positions per slot (default: the longest prompt plus ``max_new_tokens``); ``compile_only``:
    warm up (into the persistent compilation cache, if on) and serve nothing: the results carry
    only the warm-up's figures."""
    configs, prompts, cache_len = _plan(model, modes, batch, requests, max_new_tokens, seed,
                                        block_size, long_prompts, max_model_len, generation)
    return [_run_mode(model, config, batch, prompts, cache_len, progress, mesh, compile_only)
            for config in configs]


def _run_mode(model: Model, config: GenerationConfig, batch: int, prompts: list[list[int]],
              cache_len: int, progress: bool, mesh: Mesh | None,
              compile_only: bool = False) -> BenchResult:
    """One mode's run. Its engine (and KV cache) is gone when this returns, before the next
    mode's engine allocates its own: two caches at once would not fit at large batch."""
    cfg = model.config
    engine = Engine(model, config, slots=batch, cache_len=cache_len, mesh=mesh, detokenize=False)
    start = time.perf_counter()
    with count_compilations() as warmup:
        engine.warmup(prompt_lengths=[len(p) for p in prompts], run=not compile_only)
    compile_seconds = time.perf_counter() - start
    if compile_only:
        return BenchResult(
            mode=config.mode, batch=batch, requests=0, generated_tokens=0, wall_seconds=0.0,
            steps=0, processed_per_step=0.0, retained_per_step=0.0, decoded_per_step=0.0,
            sampled_per_step=0.0, model_flops=0.0, compile_seconds=compile_seconds,
            decode_seconds=0.0, prefill_seconds=0.0, host_seconds=0.0, compilations=0,
            warmup_compiled=warmup.compiled, warmup_loaded=warmup.loaded,
            kv_cache=config.kv_cache)
    for prompt in prompts:
        engine.add_request(prompt)
    with count_compilations() as compilations:
        run_to_completion(engine, progress=progress)
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
        compilations=compilations.programs, warmup_compiled=warmup.compiled,
        warmup_loaded=warmup.loaded, kv_cache=config.kv_cache, kv_pages=s.kv_pages,
        kv_pages_peak=s.kv_pages_peak, prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens, prefix_hit_rate=s.prefix_hit_rate)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of ``values`` (NaN when empty)."""
    if not values:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


@dataclasses.dataclass
class OpenLoopResult(_Throughput):
    """One mode's run under Poisson arrivals. Latencies in seconds, from each request's
    scheduled arrival: ``admission_wait`` until its prefill is done, ``first_block`` until its
    first committed block reaches the host, ``latency`` until it ends; ``per_token`` is
    ``(latency - first_block) / (tokens - 1)``."""

    mode: str
    batch: int
    request_rate: float
    requests: int
    generated_tokens: int
    wall_seconds: float
    steps: int
    decode_seconds: float
    admission_wait: dict[str, float]
    first_block: dict[str, float]
    per_token: dict[str, float]
    latency: dict[str, float]
    compilations: int
    kv_pages: int = 0
    """Pages of a paged cache's pool (0: contiguous)."""
    kv_pages_peak: int = 0
    prefix_hit_rate: float = 0.0


def run_open_loop(model: Model, mode: str, batch: int, requests: int, max_new_tokens: int,
                  request_rate: float, seed: int = 0, block_size: int | None = None,
                  mesh: Mesh | None = None, **generation: object) -> OpenLoopResult:
    """Serve ``requests`` random prompts (the closed loop's) arriving as a Poisson process of
    ``request_rate`` per second (seeded) on ``batch`` slots; greedy decoding. Throughput counts
    generated tokens over the time from the first arrival to the last completion."""
    cfg = model.config
    lengths = prompt_lengths(requests, seed)
    prompts = random_prompts(cfg, lengths, seed + 1)
    gaps = np.random.default_rng(seed + 2).exponential(1.0 / request_rate, size=requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    config = GenerationConfig(mode=mode, block_size=block_size or cfg.block_size or 32,
                              max_new_tokens=max_new_tokens, stop_token_ids=(), **generation)
    engine = Engine(model, config, slots=batch, cache_len=max(lengths) + max_new_tokens,
                    mesh=mesh, detokenize=False)
    engine.warmup(prompt_lengths=lengths)
    finished = []
    with count_compilations() as compilations:
        start = time.perf_counter()
        sent = 0
        while sent < requests or engine.has_unfinished():
            now = time.perf_counter() - start
            while sent < requests and arrivals[sent] <= now:
                engine.add_request(prompts[sent], arrival_time=start + arrivals[sent])
                sent += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, arrivals[sent] - (time.perf_counter() - start)))
                continue
            finished += [out for out in engine.step() if out.finished]
        wall = time.perf_counter() - start
    stats = [out.stats for out in finished]
    tokens = [len(out.token_ids) for out in finished]
    return OpenLoopResult(
        mode=mode, batch=batch, request_rate=request_rate, requests=requests,
        generated_tokens=sum(tokens), wall_seconds=wall, steps=engine.stats.steps,
        decode_seconds=engine.stats.decode_seconds,
        admission_wait=percentiles([s.admitted_time - s.arrival_time for s in stats]),
        first_block=percentiles([s.first_block_time - s.arrival_time for s in stats]),
        per_token=percentiles([(s.finished_time - s.first_block_time) / max(n - 1, 1)
                               for s, n in zip(stats, tokens, strict=True)]),
        latency=percentiles([s.finished_time - s.arrival_time for s in stats]),
        compilations=compilations.programs, kv_pages=engine.stats.kv_pages,
        kv_pages_peak=engine.stats.kv_pages_peak, prefix_hit_rate=engine.stats.prefix_hit_rate)
