"""A server's start-up and its first chat: ``focus-jax serve`` started with an empty persistent
compilation cache (cold), then again with the cache it left (warm). Per start: seconds until
``/health`` answers 200, then the latency of one chat completion (greedy); the server is then
stopped with SIGTERM. One JSON object (and a line per start).

    .venv/bin/python scripts/benchmark_serve_start.py --json out.json              # bundled model
    .venv/bin/python scripts/benchmark_serve_start.py -- --max-batch 32 --max-model-len 1024
    python3 scripts/benchmark_serve_start.py --json h200.json -- --model /tmp/sdar8b \\
        --max-batch 256 --max-model-len 2048                                 # SDAR-8B, a GPU

Arguments after ``--`` go to ``focus-jax serve``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Add: 257+468"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_and_chat(serve_args: list[str], cache: Path, max_tokens: int, timeout: float) -> dict:
    """Start a server with its persistent cache in ``cache``; time it to ready and one chat."""
    port = free_port()
    env = {**os.environ, "FOCUS_JAX_CACHE_DIR": str(cache),
           "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                            "0.95")}
    command = [sys.executable, "-m", "focus_jax.cli", "serve", "--port", str(port),
               "--log-level", "warning", *serve_args]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}):\n"
                                   f"{server.stderr.read()}")
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"no /health 200 within {timeout:.0f} s")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ready = time.perf_counter() - start
        asked = time.perf_counter()
        answer = httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
            "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            "temperature": 0}).json()
        chat = time.perf_counter() - asked
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    # The server's own account of its start: the load and warm-up lines it prints.
    said = [line.strip() for line in server.stderr.read().splitlines()
            if line.startswith("focus-jax serve:")]
    return {"ready_seconds": round(ready, 2), "chat_seconds": round(chat, 3), "server_said": said,
            "completion_tokens": answer["usage"]["completion_tokens"],
            "answer": answer["choices"][0]["message"]["content"],
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128, help="the chat's max_tokens")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per start, at most")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("serve_args", nargs="*", help="arguments of focus-jax serve (after --)")
    args = parser.parse_args()
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip(),
              "serve_args": args.serve_args, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="focus_jax_cache_") as folder:
        for run in ("cold", "warm"):
            report[run] = start_and_chat(args.serve_args, Path(folder), args.max_tokens,
                                         args.timeout)
            print(run, json.dumps(report[run]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
