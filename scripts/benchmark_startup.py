"""Wall time of a newcomer's first answers: ``focus-jax generate`` (one prompt, bundled model) in a
process with an empty persistent compilation cache and again with the cache it left, per bucket
ladder; and ``focus-jax demo`` the same two ways. Each run is a fresh process, as on the command
line; its ``--stats`` lines split the time into compilation, decoding and the rest (imports,
loading the model). The machine's load average is recorded next to every run.

    .venv/bin/python scripts/benchmark_startup.py --json docs/data/startup.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from focus_jax.config import CPU_LADDER, DEFAULT_LADDER

ROOT = Path(__file__).resolve().parents[1]
FOCUS_JAX = Path(sys.executable).parent / "focus-jax"
PROMPT = "Add: 257+468"
LADDERS: dict[str, tuple[float, ...] | None] = {
    "platform default": None,
    "16 (DEFAULT_LADDER)": DEFAULT_LADDER,
    "8 (eighths)": tuple(k / 8 for k in range(1, 9)),
    "4 (quarters)": (0.25, 0.5, 0.75, 1.0),
    "3 (0.25, 0.5, 1)": (0.25, 0.5, 1.0),
    "2 (halves)": (0.5, 1.0),
    "1 (whole block)": (1.0,),
}
COMPILATION = re.compile(r"compilation: (\d+) programs compiled, (\d+) read from .*, ([\d.]+)s")
RUN = re.compile(r"in ([\d.]+)s \([\d.]+ tok/s\): decode rounds ([\d.]+)s, prefill ([\d.]+)s")


def timed(command: list[str], cache: Path | None) -> dict:
    """Run ``command`` in a fresh process (the persistent cache in ``cache``, or off); its wall
    time, the load average around it and what its --stats lines say."""
    env = {**os.environ, "FOCUS_JAX_CACHE_DIR": str(cache or "")}
    if cache is None:
        command = [*command, "--no-compile-cache"]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    row = {"wall_seconds": round(wall, 2), "load_before": load_before,
           "load_after": os.getloadavg()[0]}
    if match := COMPILATION.search(done.stderr + done.stdout):
        row.update(compiled=int(match[1]), read=int(match[2]),
                   compile_seconds=float(match[3]))
    runs = RUN.findall(done.stderr + done.stdout)
    row["run_seconds"] = round(sum(float(r[0]) for r in runs), 2)
    row["decode_seconds"] = round(sum(float(r[1]) for r in runs), 2)
    return row


def fresh_and_again(command: list[str]) -> dict:
    """``command`` with an empty persistent cache, then again with the cache it wrote."""
    folder = Path(tempfile.mkdtemp(prefix="focus_jax_cache_"))
    try:
        return {"fresh": timed(command, folder), "again": timed(command, folder),
                "cache_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())}
    finally:
        shutil.rmtree(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ladders", default=",".join(LADDERS),
                        help=f"comma-separated names among {list(LADDERS)}")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "jax": jax.__version__, "cpu_ladder": CPU_LADDER,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip(),
              "generate": {}}
    names = [n for n in LADDERS if n in args.ladders.split(",")]
    for name in names:
        command = [str(FOCUS_JAX), "generate", "--prompt", PROMPT, "--stats"]
        if LADDERS[name] is not None:
            command += ["--bucket-ladder", ",".join(f"{f:g}" for f in LADDERS[name])]
        report["generate"][name] = fresh_and_again(command)
        print(name, json.dumps(report["generate"][name]), flush=True)
    if not args.skip_demo:
        demo = [str(FOCUS_JAX), "demo"]
        report["demo"] = fresh_and_again(demo)
        print("demo", json.dumps(report["demo"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
