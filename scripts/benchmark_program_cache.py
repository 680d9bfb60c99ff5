"""Resident memory of a long-lived process that meets ever new generation settings: one prompt to
the bundled model per setting (FOCUS's alpha changes, so each needs its own decode round), the
process's RSS and live executables after each. With ``--capacity`` the program cache keeps that
many programs (``compilation.PROGRAM_CAPACITY`` by default); ``--capacity 0`` keeps every one, as
``jax.jit``'s own cache of static arguments did before.

    .venv/bin/python scripts/benchmark_program_cache.py --settings 24 --json docs/data/program_cache.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
from pathlib import Path

import jax

from focus_jax import GenerationConfig, compilation, generate
from focus_jax.cli import load_model


def rss_mib() -> float:
    """Resident set size of this process (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", type=int, default=24)
    parser.add_argument("--capacity", type=int, default=compilation.PROGRAM_CAPACITY,
                        help="programs kept (0: all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    # Compiled afresh in every run: the point is what compiling and keeping costs in memory.
    jax.config.update("jax_enable_compilation_cache", False)
    compilation.PROGRAMS = compilation.ProgramCache(args.capacity or 10**9)
    model = load_model(None)
    client = jax.devices()[0].client
    rows = []
    for i in range(args.settings):
        config = GenerationConfig(alpha=1.0 + i / 100, max_new_tokens=64)
        generate(model, "Add: 257+468", config)
        gc.collect()
        rows.append({"settings": i + 1, "rss_mib": round(rss_mib(), 1),
                     "live_executables": len(client.live_executables()),
                     "programs_kept": len(compilation.PROGRAMS)})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "machine": f"{os.cpu_count()} cores", "jax": jax.__version__,
                  "capacity": args.capacity, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
