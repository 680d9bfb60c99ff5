"""Online serving benchmark: start a server, send the load client's request set at each rate,
stop the server; one JSON line per rate (the load client's report plus the server's settings).

The same request set for every server (``focus_jax.serve.load``: the offline bench's prompt
lengths, random prompt tokens sent as text, a fixed number of output tokens, greedy). Servers:
``focus-jax`` (our ``focus-jax serve``, ``--mode baseline|delayed|focus``) and ``lmdeploy``
(LMDeploy's ``api_server`` with its dLLM settings matched to ours: block 32,
``low_confidence_dynamic``, threshold 0.9; it must be importable, e.g. through ``PYTHONPATH``).

    python scripts/benchmark_serving.py --server focus-jax --mode focus --model-dir /tmp/sdar8b \\
        --max-batch 256 --rates 2,4,12,inf --num-requests 256 --out results/serving.jsonl
    PYTHONPATH=/tmp/site python scripts/benchmark_serving.py --server lmdeploy \\
        --model-dir /tmp/sdar8b --max-batch 256 --rates 2,4,12,inf --out results/serving.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from focus_jax.serve import load


def server_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment."""
    if args.server == "focus-jax":
        command = [sys.executable, "-m", "focus_jax.cli", "serve", "--model", str(args.model_dir),
                   "--mode", args.mode, "--max-batch", str(args.max_batch),
                   "--max-queue", str(args.num_requests + args.warmup_requests),
                   "--max-model-len", str(args.max_model_len), "--port", str(args.port),
                   "--log-level", "warning"]
        if args.bucket_ladder:
            command += ["--bucket-ladder", args.bucket_ladder]
        if args.kernels:
            command += ["--kernels", args.kernels]
        command += args.server_arg
        return command, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    command = [sys.executable, "-m", "lmdeploy", "serve", "api_server", str(args.model_dir),
               "--backend", "pytorch", "--server-name", "127.0.0.1", "--server-port", str(args.port),
               "--max-batch-size", str(args.max_batch), "--session-len", str(args.max_model_len),
               "--cache-max-entry-count", str(args.cache_max_entry_count),
               "--dllm-block-length", "32", "--dllm-unmasking-strategy", "low_confidence_dynamic",
               "--dllm-denoising-steps", "32", "--dllm-confidence-threshold", "0.9",
               "--distributed-executor-backend", "uni", "--log-level", "WARNING"]
    return command, {"LMDEPLOY_ENABLE_CHECK_ENV": "0"}


def requests_at(rate: float, args: argparse.Namespace) -> int:
    """How many requests to send at ``rate``: all of them, or a ``--send-seconds`` window's."""
    if args.send_seconds is None or math.isinf(rate):
        return args.num_requests
    return min(args.num_requests, max(args.min_requests, math.ceil(rate * args.send_seconds)))


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``url``/v1/models answers 200; raises if the server dies or times out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"the server did not answer within {timeout:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=("focus-jax", "lmdeploy"), required=True)
    parser.add_argument("--mode", default="focus", help="focus-jax only")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1536,
                        help="context per request: the longest prompt (1024, a little more once "
                             "its text is tokenized again) plus 256 new tokens")
    parser.add_argument("--bucket-ladder", default=None, help="focus-jax only")
    parser.add_argument("--kernels", default=None, help="focus-jax only")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="focus-jax only: one more argument for `focus-jax serve` (repeat)")
    parser.add_argument("--cache-max-entry-count", type=float, default=0.5, help="lmdeploy only")
    parser.add_argument("--rates", default="2,4,12,inf", help="requests/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--send-seconds", type=float, default=None,
                        help="at a finite rate, send at most rate x this many requests (at least "
                             "--min-requests): bounds the time a slow rate takes")
    parser.add_argument("--min-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-len", type=int, default=load.bench.PROMPT_MAX)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens of one system prompt before every prompt (default: none)")
    parser.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                        help="prompts as text or as token ids (focus-jax takes ids)")
    parser.add_argument("--warmup-requests", type=int, default=32)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    args = parser.parse_args()

    command, env = server_command(args)
    url = f"http://127.0.0.1:{args.port}"
    process = subprocess.Popen(command, env={**os.environ, **env})
    try:
        started = wait_ready(url, process, args.start_timeout)
        print(f"{args.server} ready after {started:.0f} s", file=sys.stderr, flush=True)
        for index, rate in enumerate(float(r) for r in args.rates.split(",")):
            workload = load.Workload(requests_at(rate, args), rate, args.max_tokens,
                                     max_prompt_len=args.max_prompt_len,
                                     prompt_format=args.prompt_format,
                                     shared_prefix=args.shared_prefix)
            report = asyncio.run(load.run(url, workload, workload.prompts(args.model_dir),
                                          warmup_requests=args.warmup_requests if index == 0 else 0))
            row = {"server": args.server, "mode": args.mode if args.server == "focus-jax" else None,
                   "max_batch": args.max_batch, "max_model_len": args.max_model_len,
                   "server_args": args.server_arg,
                   "start_seconds": started, **report}
            print(f"{args.server} {row['mode'] or ''} bs{args.max_batch} rate {report['rate']}: "
                  f"{report['output_tokens_per_second']:.1f} tok/s, first block p50 "
                  f"{report['time_to_first_block']['p50']:.3f} s, e2e p50 "
                  f"{report['end_to_end']['p50']:.2f} s, failed {report['failed']}", flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with args.out.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
