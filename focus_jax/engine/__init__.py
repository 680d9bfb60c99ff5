"""The serving engine: a request lifecycle (``add_request`` / ``abort`` / ``step``) over a
scheduler (which request runs in which slot), a runner (the compiled device programs) and an
output processor (statistics, incremental tokens and text); :class:`AsyncEngine` runs it on a
background thread for servers."""

from focus_jax.engine.async_engine import AsyncEngine, EngineClosed, QueueFull
from focus_jax.engine.core import Engine, compile_ahead, run_to_completion
from focus_jax.engine.output import RequestOutput, RequestStats, Result, RunStats, token_layer_split
from focus_jax.engine.params import RequestError, SamplingParams
from focus_jax.engine.runner import cache_length, check_memory_fits, prompt_buckets

__all__ = ["AsyncEngine", "Engine", "EngineClosed", "QueueFull", "RequestError", "RequestOutput",
           "RequestStats", "Result", "RunStats", "SamplingParams", "cache_length",
           "check_memory_fits", "compile_ahead", "prompt_buckets", "run_to_completion", "token_layer_split"]
