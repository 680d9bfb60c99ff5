"""The three-line Python API: ``load``, ``GenerationConfig``, ``generate``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jax.sharding import Mesh

from focus_jax import compilation
from focus_jax.config import ConfigError, GenerationConfig
from focus_jax.engine import Engine, RequestError, Result, RunStats, SamplingParams, cache_length
from focus_jax.engine.core import run_to_completion
from focus_jax.model import Model
from focus_jax.prompts import Prompt, encode_prompt, is_single

DEFAULT_MAX_BATCH = 64


def generate(model: Model, prompts: Prompt | Sequence[Prompt],
             config: GenerationConfig | None = None, *, chat: bool = True,
             progress: bool = False,
             on_tokens: Callable[[int, list[int]], None] | None = None,
             return_stats: bool = False,
             mesh: Mesh | None = None) -> list[Result] | tuple[list[Result], RunStats]:
    """Generate for one prompt or a list of prompts: text, or token ids (a list of integers,
    Python or NumPy, or a 1-D integer array; a 2-D array is a list of prompts).

    Returns one :class:`Result` per prompt, in order (``.text``, ``.token_ids``, ``.stats``);
    with ``return_stats`` also the run's :class:`RunStats`. ``on_tokens(index, ids)`` streams
    each prompt's tokens as its blocks complete. ``mesh``: decode sharded over a
    ``("data", "model")`` mesh (slots over data: the batch is rounded up to a multiple of it).

    Every program the run needs is compiled (or read from the persistent compilation cache)
    before the first token, and the whole run uses them: the same call gives the same tokens
    whether the cache was empty, warm or off.

    Raises ``TypeError`` for a prompt that is neither text nor token ids (bytes, a dict, float
    ids), :class:`RequestError` for one the model cannot take and ``ConfigError`` for settings.
    """
    compilation.use_persistent_cache()  # before the first compilation, the state's included
    config = GenerationConfig() if config is None else config
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
    if is_single(prompts):
        ids = [encode_prompt(model, prompts, chat)]
    else:
        if not isinstance(prompts, Sequence) and not hasattr(prompts, "ndim"):
            raise TypeError(f"prompts must be text, token ids or a list of them, got "
                            f"{type(prompts).__name__}")
        ids = [encode_prompt(model, p, chat, name=f"prompt {i}") for i, p in enumerate(prompts)]
    if not ids:
        raise RequestError("no prompts given")
    block = config.block_size or model.config.block_size or 0
    longest = max(len(p) for p in ids)
    cache_len = config.max_cache_len
    if cache_len is None and block:
        cache_len = cache_length(block, longest + config.max_new_tokens)
    if cache_len is not None and longest + config.max_new_tokens > model.config.max_position_embeddings:
        raise ConfigError(
            f"prompt of {longest} tokens plus max_new_tokens={config.max_new_tokens} exceeds the "
            f"model's max_position_embeddings ({model.config.max_position_embeddings})")
    slots = config.max_batch or min(1 << (len(ids) - 1).bit_length(), DEFAULT_MAX_BATCH)
    if mesh is not None and config.max_batch is None:
        data = mesh.shape["data"]
        slots = -(-slots // data) * data
    engine = Engine(model, config, slots=slots, cache_len=cache_len, mesh=mesh)
    # Request i samples with seed config.seed + i: the same prompt twice gets two draws.
    rids = [engine.add_request(p, SamplingParams.from_config(config, seed=config.seed + i))
            for i, p in enumerate(ids)]
    index = {rid: i for i, rid in enumerate(rids)}
    # Compile first (only the programs these prompts need), so the statistics time the run.
    engine.warmup(prompt_lengths=[len(p) for p in ids])

    def stream(out) -> None:
        if on_tokens is not None and out.new_token_ids:
            on_tokens(index[out.request_id], out.new_token_ids)

    results = run_to_completion(engine, progress=progress, on_output=stream)
    ordered = [results[rid] for rid in rids]
    return (ordered, engine.stats) if return_stats else ordered
