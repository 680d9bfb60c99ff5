"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own.

Requests by outcome, queue length and running slots, tokens (prompt tokens from the prefix
cache among them), KV cache pages used and in all (a paged cache), time to the first committed
block and end-to-end latency (both from the request's arrival at the server), and tokens decoded
per denoising step of each request; plus the engine's own counters (steps, token-steps through the
layers) and the XLA compilations since serving began, read when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from focus_jax.compilation import Compilations
from focus_jax.engine import AsyncEngine, RequestOutput

OUTCOMES = ("stop", "length", "abort", "error", "invalid", "rejected")
"""``stop`` / ``length``: finished (a stop token or string, or the token limit); ``abort``: the
client went away or the server shut down first; ``error``: the engine failed the request;
``invalid``: refused with a 4xx before it ran; ``rejected``: queue full or server closing."""

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_DECODED = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class ServerMetrics:
    """Metrics of one server over ``engine``."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("focus_jax_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        Gauge("focus_jax_queue_length", "Requests waiting for a slot",
              registry=r).set_function(lambda: engine.num_waiting)
        Gauge("focus_jax_running_slots", "Slots decoding a request",
              registry=r).set_function(lambda: engine.num_running)
        Gauge("focus_jax_slots", "Slots of the engine", registry=r).set(engine.engine.slots)
        self.prompt_tokens = Counter("focus_jax_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.prefix_hit_tokens = Counter(
            "focus_jax_prefix_cache_hit_tokens",
            "Prompt tokens of finished requests whose KV came from the prefix cache (hit rate: "
            "over focus_jax_prompt_tokens_total)", registry=r)
        pool = engine.engine.scheduler.pool
        if pool is not None:  # a paged KV cache
            Gauge("focus_jax_kv_pages_used", "KV cache pages requests hold",
                  registry=r).set_function(lambda: pool.held)
            Gauge("focus_jax_kv_pages_total", "KV cache pages in the pool",
                  registry=r).set(pool.total)
        self.generated_tokens = Counter("focus_jax_generated_tokens",
                                        "Tokens generated for clients (usage completion_tokens)",
                                        registry=r)
        self.first_block = Histogram("focus_jax_time_to_first_block_seconds",
                                     "From arrival to the first committed block", buckets=_SECONDS,
                                     registry=r)
        self.latency = Histogram("focus_jax_request_latency_seconds",
                                 "From arrival to the last output", buckets=_SECONDS, registry=r)
        self.decoded_per_step = Histogram("focus_jax_decoded_tokens_per_step",
                                          "Tokens a request decoded per denoising step",
                                          buckets=_DECODED, registry=r)
        self.compilations = Compilations()
        """XLA compilations while serving (the app's lifespan collects them): should stay 0."""
        r.register(_EngineCounters(engine, self))

    def finished(self, outcome: str, out: RequestOutput | None, completion_tokens: int,
                 latency: float) -> None:
        """Record a request that ran (``out``: its last output)."""
        self.requests.labels(outcome).inc()
        self.latency.observe(latency)
        self.generated_tokens.inc(completion_tokens)
        if out is not None:
            self.prompt_tokens.inc(out.prompt_tokens)
            self.prefix_hit_tokens.inc(out.stats.cached_prompt_tokens)
            for decoded in out.stats.decoded_per_step:
                self.decoded_per_step.observe(decoded)

    def refused(self, outcome: str) -> None:
        """Record a request refused before it ran."""
        self.requests.labels(outcome).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters(Collector):
    """The engine's run statistics, read at scrape time."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("focus_jax_compilations", "XLA compilations while serving "
                                  "(warm-up compiles every program first: should stay 0)",
                                  value=self.metrics.compilations.programs)
        stats = self.engine.engine.stats
        for name, value, text in (
                ("steps", stats.steps, "Denoising steps run (all slots together)"),
                ("decoded_tokens", stats.decoded_tokens, "Tokens decoded (all slots)"),
                ("processed_tokens", stats.processed_tokens, "Token-steps through layers 0-1"),
                ("retained_tokens", stats.retained_tokens, "Token-steps through layers >= 2")):
            yield CounterMetricFamily(f"focus_jax_engine_{name}", text, value=value)
