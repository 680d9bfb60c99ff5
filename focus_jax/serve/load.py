"""A load client for any OpenAI-compatible server: one seeded request set sent at a Poisson rate
to ``POST /v1/completions`` with streaming; throughput and latency percentiles as JSON.

The request set is the offline benchmark's (:mod:`focus_jax.bench`): prompt lengths drawn
log-normal (median 120 tokens, clipped), prompt token ids uniform over the vocabulary (seed + 1),
and every request asks for exactly ``--max-tokens`` tokens (``ignore_eos``, greedy). Prompts go
as text (the ids detokenised with the model folder's tokenizer; the server tokenizes them
again, so prompt lengths shift slightly: the report gives the servers' own counts) or, with
``--prompt-format ids``, as token-id lists (servers that take them, such as ours). Plain OpenAI
wire format plus ``ignore_eos``, which LMDeploy's and vLLM's servers take too.

Measured per request from the moment it is sent: time to the first streamed text (first block),
times between text chunks (blocks), end to end. Output tok/s counts the servers' reported
completion tokens over the run's wall time (first send to last end).

    python -m focus_jax.serve.load --url http://127.0.0.1:8000 --model-dir /tmp/sdar8b \\
        --num-requests 512 --rate 8 --max-tokens 256 --out serve_focus_rate8.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from focus_jax import bench
from focus_jax.checkpoint import load_tokenizer
from focus_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Workload:
    """The request set and how it is sent."""

    num_requests: int = 256
    rate: float = math.inf
    """Requests per second, Poisson arrivals; ``inf``: all at once."""
    max_tokens: int = 256
    seed: int = 0
    max_prompt_len: int = bench.PROMPT_MAX
    prompt_format: str = "text"
    """``text`` (detokenised ids) or ``ids`` (token-id lists)."""
    shared_prefix: int = 0
    """Tokens of one system prompt every prompt begins with (seeded; 0: none)."""

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.max_tokens < 1:
            raise ValueError("num_requests and max_tokens must be >= 1")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {self.rate}")
        if self.prompt_format not in ("text", "ids"):
            raise ValueError(f"prompt_format must be 'text' or 'ids', got {self.prompt_format!r}")

    def prompts(self, model_dir: Path) -> list[str] | list[list[int]]:
        """The seeded prompts (the vocabulary and tokenizer from ``model_dir``)."""
        cfg = ModelConfig.from_file(model_dir / "config.json")
        lengths = bench.prompt_lengths(self.num_requests, self.seed, self.max_prompt_len)
        ids = bench.random_prompts(cfg, lengths, self.seed + 1)
        if self.shared_prefix:
            system = bench.random_prompts(cfg, [self.shared_prefix], self.seed + 5)[0]
            ids = [system + p for p in ids]
        if self.prompt_format == "ids":
            return ids
        tokenizer = load_tokenizer(model_dir)
        return [tokenizer.decode(p) for p in ids]

    def send_times(self) -> np.ndarray:
        """Seconds after the start at which each request is sent."""
        if math.isinf(self.rate):
            return np.zeros(self.num_requests)
        gaps = np.random.default_rng(self.seed + 2).exponential(1 / self.rate, self.num_requests)
        return np.concatenate([[0.0], np.cumsum(gaps[1:])])


@dataclasses.dataclass
class Record:
    """One request as the client saw it (``time.perf_counter()`` readings)."""

    sent: float
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    """When each event with text arrived."""
    end: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], delay: float,
               start: float) -> Record:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))  # its Poisson send time
    record = Record(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    record.error = f"error event: {event['error']}"
                    break
                if any(choice.get("text") for choice in event.get("choices") or ()):
                    record.chunk_times.append(time.perf_counter())
                if event.get("usage"):
                    record.prompt_tokens = event["usage"].get("prompt_tokens")
                    record.completion_tokens = event["usage"].get("completion_tokens")
    except httpx.HTTPError as err:
        record.error = f"{type(err).__name__}: {err}"
    record.end = time.perf_counter()
    return record


async def run(url: str, workload: Workload, prompts: Sequence[str] | Sequence[list[int]], *,
              model: str | None = None, api_key: str | None = None, timeout: float = 3600.0,
              warmup_requests: int = 0) -> dict[str, Any]:
    """Send the workload to ``url`` (the server's base, ``/v1/completions`` is appended) and
    return the report. ``model``: the served name (default: the first of ``/v1/models``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout)) as client:
        if model is None:
            listed = await client.get("/v1/models")
            listed.raise_for_status()
            model = listed.json()["data"][0]["id"]

        def body(prompt: str | list[int]) -> dict[str, Any]:
            return {"model": model, "prompt": prompt, "max_tokens": workload.max_tokens,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}

        if warmup_requests:
            now = time.perf_counter()
            await asyncio.gather(*(_one(client, "/v1/completions", body(p), 0.0, now)
                                   for p in prompts[:warmup_requests]))
        start = time.perf_counter()
        records = await asyncio.gather(*(
            _one(client, "/v1/completions", body(p), float(delay), start)
            for p, delay in zip(prompts, workload.send_times(), strict=True)))
    return report(url, model, workload, list(records), start)


def report(url: str, model: str, workload: Workload, records: list[Record],
           start: float) -> dict[str, Any]:
    """The run's summary: throughput over the wall time, latencies in seconds."""
    done = [r for r in records if r.error is None and r.end is not None]
    end = max((r.end for r in records if r.end is not None), default=start)
    wall = end - start
    tokens = sum(r.completion_tokens or 0 for r in done)
    return {
        "url": url, "model": model,
        **dataclasses.asdict(workload) | {"rate": workload.rate if math.isfinite(workload.rate)
                                          else "inf"},
        "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_seconds": wall,
        "output_tokens": tokens,
        "output_tokens_per_second": tokens / wall if wall > 0 else None,
        "requests_per_second": len(done) / wall if wall > 0 else None,
        "short_outputs": sum(r.completion_tokens != workload.max_tokens for r in done),
        "mean_prompt_tokens": (float(np.mean([r.prompt_tokens for r in done]))
                               if done and all(r.prompt_tokens is not None for r in done) else None),
        "time_to_first_block": bench.percentiles([r.chunk_times[0] - r.sent for r in done
                                             if r.chunk_times]),
        "time_between_blocks": bench.percentiles([b - a for r in done
                                             for a, b in itertools.pairwise(r.chunk_times)]),
        "end_to_end": bench.percentiles([r.end - r.sent for r in done]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m focus_jax.serve.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model-dir", type=Path, required=True,
                        help="the served model's folder (config.json for the vocabulary, the "
                             "tokenizer for text prompts)")
    parser.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-len", type=int, default=bench.PROMPT_MAX)
    parser.add_argument("--prompt-format", choices=("text", "ids"), default="text")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of a system prompt every prompt begins with (default: none)")
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="requests sent (all at once) before the timed run, not counted")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    try:
        workload = Workload(args.num_requests, args.rate, args.max_tokens, args.seed,
                            args.max_prompt_len, args.prompt_format, args.shared_prefix)
        prompts = workload.prompts(args.model_dir)
        result = asyncio.run(run(args.url, workload, prompts, model=args.model,
                                 api_key=args.api_key, timeout=args.timeout,
                                 warmup_requests=args.warmup_requests))
    except (ValueError, OSError, httpx.HTTPError) as err:
        print(f"load: error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
