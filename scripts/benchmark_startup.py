"""Time to a newcomer's first answers, and what each bucket ladder costs on this machine.

1. ``focus-jax generate`` (one prompt, bundled model) per bucket ladder, in a process with an
   empty persistent compilation cache and no bytecode of the project (as in a fresh clone), then
   again with the cache it left; ``focus-jax demo`` (what ``make demo`` runs once the virtual
   environment is installed) the same two ways. Each run is a fresh
   process, as on the command line: its wall time, its CPU time (user + system, all threads:
   less sensitive than wall time to other jobs on a shared machine) and the split its output
   gives (compilation, decoding; the rest is imports and loading the model).
2. ``--batch N``: in this process, per ladder, the CPU time to compile the decode round for N
   slots and to decode N held-out questions in focus mode (what a ladder costs a larger run).

The machine's load average is recorded next to every measurement.

    .venv/bin/python scripts/benchmark_startup.py --json docs/data/startup.json
    .venv/bin/python scripts/benchmark_startup.py --skip-cli --batch 64 --json docs/data/ladders.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax

from focus_jax.config import CPU_LADDER, DEFAULT_LADDER

ROOT = Path(__file__).resolve().parents[1]
FOCUS_JAX = Path(sys.executable).parent / "focus-jax"
PROMPT = "Add: 257+468"
LADDERS: dict[str, tuple[float, ...] | None] = {
    "platform default": None,
    "16": DEFAULT_LADDER,
    "8": tuple(k / 8 for k in range(1, 9)),
    "4": (0.25, 0.5, 0.75, 1.0),
    "3": (0.25, 0.5, 1.0),
    "2": (0.5, 1.0),
    "1": (1.0,),
}
COMPILATION = re.compile(r"compilation: (\d+) programs compiled, (\d+) read from .*, ([\d.]+)s")
RUN = re.compile(r"in ([\d.]+)s \([\d.]+ tok/s\): decode rounds ([\d.]+)s, prefill ([\d.]+)s")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], cache: Path) -> dict:
    """Run ``command`` in a fresh process with its persistent cache in ``cache``: wall and CPU
    time, when its standard output began and when it last wrote there (the answer streamed and
    complete), the load average before and after, and what its output says."""
    env = {**os.environ, "FOCUS_JAX_CACHE_DIR": str(cache)}
    load_before, cpu_before = os.getloadavg()[0], children_cpu_seconds()
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=ROOT)
    stderr: list[bytes] = []
    reader = threading.Thread(target=lambda: stderr.append(process.stderr.read()))
    reader.start()
    stdout, stamps = b"", []
    while chunk := process.stdout.read1(65536):
        stdout += chunk
        stamps.append(time.perf_counter() - start)
    process.wait()
    reader.join()
    wall = time.perf_counter() - start
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[0].decode()}")
    output = stderr[0].decode() + stdout.decode()
    row = {"wall_seconds": round(wall, 2),
           "first_output_seconds": round(stamps[0], 2) if stamps else None,
           "output_done_seconds": round(stamps[-1], 2) if stamps else None,
           "cpu_seconds": round(children_cpu_seconds() - cpu_before, 2),
           "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    if match := COMPILATION.search(output):
        row.update(compiled=int(match[1]), read=int(match[2]), compile_seconds=float(match[3]))
    runs = RUN.findall(output)
    row["decode_seconds"] = round(sum(float(r[1]) for r in runs), 2)
    row["prefill_seconds"] = round(sum(float(r[2]) for r in runs), 2)
    return row


def fresh_and_again(command: list[str]) -> dict:
    """``command`` as in a fresh clone (an empty persistent cache, no bytecode of the project's
    own modules), then again with the cache it wrote."""
    for bytecode in [*ROOT.glob("focus_jax/**/__pycache__"),
                     *ROOT.glob("pallas_kernels/**/__pycache__")]:
        shutil.rmtree(bytecode, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix="focus_jax_cache_"))
    try:
        return {"fresh": timed(command, folder), "again": timed(command, folder),
                "cache_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())}
    finally:
        shutil.rmtree(folder)


def ladder_costs(names: list[str], batch: int) -> dict:
    """Per ladder: CPU seconds to compile the decode round for ``batch`` slots (the round alone),
    and to decode ``batch`` held-out questions in focus mode (128 new tokens), with the answers'
    exact match."""
    from focus_jax import GenerationConfig, tasks
    from focus_jax.cli import load_model
    from focus_jax.engine import Engine, cache_length, run_to_completion
    from focus_jax.prompts import encode_prompt

    jax.config.update("jax_enable_compilation_cache", False)  # compile every ladder afresh
    model = load_model(None)
    examples = tasks.held_out(-(-batch // len(tasks.WORKED)), tasks=tasks.WORKED)[:batch]
    prompts = [encode_prompt(model, e.question) for e in examples]
    positions = cache_length(model.config.block_size, max(map(len, prompts)) + 128)
    rows = {}
    for name in names:
        config = GenerationConfig(mode="focus", max_new_tokens=128,
                                  bucket_ladder=LADDERS[name] or CPU_LADDER)
        engine = Engine(model, config, slots=batch, cache_len=positions)
        # Only the decode round is timed: the prefill programs do not depend on the ladder (the
        # first ladder's warm-up would pay for them all).
        load, start = os.getloadavg()[0], time.process_time()
        engine.lower_round().compile()
        compile_cpu = time.process_time() - start
        engine.warmup()  # the prefill programs; the round is already compiled
        ids = [engine.add_request(p) for p in prompts]
        start = time.process_time()
        results = run_to_completion(engine)
        rows[name] = {"compile_cpu_seconds": round(compile_cpu, 1),
                      "decode_cpu_seconds": round(time.process_time() - start, 2),
                      "decode_seconds": round(engine.stats.decode_seconds, 2),
                      "steps": engine.stats.steps,
                      "correct": sum(tasks.exact_match(results[i].text or "", e.answer)
                                     for i, e in zip(ids, examples, strict=True)),
                      "questions": len(examples), "load_before": round(load, 2),
                      "load_after": round(os.getloadavg()[0], 2)}
        print(name, json.dumps(rows[name]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ladders", default=",".join(LADDERS),
                        help=f"comma-separated names among {list(LADDERS)}")
    parser.add_argument("--skip-cli", action="store_true", help="no generate/demo processes")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--prompt", default=PROMPT, help="generate's prompt")
    parser.add_argument("--batch", type=int, default=0,
                        help="also compare the ladders at this many slots (0: no)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    names = [n for n in args.ladders.split(",") if n in LADDERS]

    report: dict = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "jax": jax.__version__,
        "cpu_ladder": CPU_LADDER,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip()}
    if not args.skip_cli:
        report["generate"] = {}
        for name in names:
            command = [str(FOCUS_JAX), "generate", "--prompt", args.prompt, "--stats"]
            if LADDERS[name] is not None:
                command += ["--bucket-ladder", ",".join(f"{f:g}" for f in LADDERS[name])]
            report["generate"][name] = fresh_and_again(command)
            print(name, json.dumps(report["generate"][name]), flush=True)
        if not args.skip_demo:
            report["demo"] = fresh_and_again([str(FOCUS_JAX), "demo"])
            print("demo", json.dumps(report["demo"]), flush=True)
    if args.batch:
        report[f"batch_{args.batch}"] = ladder_costs([n for n in names if LADDERS[n]],
                                                     args.batch)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
