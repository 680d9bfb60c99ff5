"""How much a request's greedy tokens depend on its neighbours in the batch (bfloat16).

The bundled model (bfloat16) decodes N held-out questions of the worked suite (focus mode, 128
new tokens) two ways per setting: all N together in one engine, and each alone. Counted: the
requests whose tokens differ between the two.

Settings:

- ``default``: alone is ``focus_jax.generate(model, prompt)`` (one slot, a cache for that prompt),
  together is ``generate(model, prompts)`` (N slots, a cache for the longest): what a user gets.
- ``fixed-shape``: one engine of N slots and one cache length for both; alone, one request at a
  time in it. The bucket the rows run in still follows the number of rows.
- ``one-bucket``: a fixed shape and ``bucket_ladder=(1.0,)``: also every compaction runs the whole
  slots x block rows, so no matrix shape depends on the neighbours.

    .venv/bin/python scripts/batch_invariance.py --json docs/data/batch_invariance.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import focus_jax
from focus_jax import tasks
from focus_jax.cli import load_model
from focus_jax.engine import Engine, cache_length, run_to_completion
from focus_jax.prompts import encode_prompt

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 128


def engine_tokens(engine: Engine, prompts: list[list[int]], together: bool) -> list[list[int]]:
    """Each prompt's tokens from ``engine``: all at once, or one request at a time."""
    if together:
        ids = [engine.add_request(p) for p in prompts]
        results = run_to_completion(engine)
        return [results[i].token_ids for i in ids]
    out = []
    for prompt in prompts:
        rid = engine.add_request(prompt)
        out.append(run_to_completion(engine)[rid].token_ids)
    return out


def compare(name: str, alone: dict[int, list[int]], together: list[list[int]],
            seconds: dict) -> dict:
    differ = [i for i, tokens in alone.items() if tokens != together[i]]
    row = {"requests": len(alone), "differ": len(differ), "differing_requests": differ,
           **{k: round(v, 1) for k, v in seconds.items()}}
    print(name, json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--settings", default="default,fixed-shape,one-bucket",
                        help="comma-separated, among default, fixed-shape, one-bucket")
    parser.add_argument("--alone", default=None,
                        help="decode only these requests alone (comma-separated indices; "
                             "default: all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model = load_model(None)
    examples = tasks.held_out(-(-args.requests // len(tasks.WORKED)),
                              tasks=tasks.WORKED)[:args.requests]
    prompts = [encode_prompt(model, e.question) for e in examples]
    chosen = ([int(i) for i in args.alone.split(",")] if args.alone
              else list(range(len(prompts))))
    block = model.config.block_size
    positions = cache_length(block, max(map(len, prompts)) + NEW_TOKENS)
    config = focus_jax.GenerationConfig(mode="focus", max_new_tokens=NEW_TOKENS)
    report: dict = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "cores": os.cpu_count(), "dtype": model.config.dtype, "new_tokens": NEW_TOKENS,
        "cache_positions": positions, "load_before": os.getloadavg()[0]}
    for name in args.settings.split(","):
        start = time.perf_counter()
        if name == "default":
            together = [r.token_ids for r in focus_jax.generate(model, prompts, config)]
            middle = time.perf_counter()
            alone = {i: focus_jax.generate(model, prompts[i], config)[0].token_ids
                     for i in chosen}
        else:
            ladder = {"bucket_ladder": (1.0,)} if name == "one-bucket" else {}
            engine = Engine(model, config.replace(**ladder), slots=len(prompts),
                            cache_len=positions)
            engine.warmup()
            start = time.perf_counter()
            together = engine_tokens(engine, prompts, together=True)
            middle = time.perf_counter()
            alone = dict(zip(chosen, engine_tokens(engine, [prompts[i] for i in chosen],
                                                   together=False), strict=True))
        end = time.perf_counter()
        report[name] = compare(name, alone, together, {"together_seconds": middle - start,
                                                       "alone_seconds": end - middle})
    report["load_after"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
