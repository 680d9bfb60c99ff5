"""The largest batch whose decode round fits a TPU slice, from real TPU compiles (docs/tpu.md).

    python scripts/tpu_capacity.py --geometry sdar-8b --topology v5e:2x4 --mesh data=2,model=4 \\
        --max-len 4096 --step 8 --json docs/data/tpu_capacity.json

Uses compile-check's machinery (``focus_jax.compile_check``). The first candidate is the largest
multiple of ``--step`` whose weights and decode state fit the chip; a decode round the compiler
refuses as too big compiles in seconds, one that fits takes minutes, so the search comes from
above (:func:`largest_batch`) and ends with a fit one step below a refusal. At the batch
found, the round of every other mode is compiled too, and prefill at the longest prompt bucket
that fits (walking down the engine's buckets). Rows are appended to ``--json`` (one object per
mode).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

from focus_jax import GenerationConfig, compile_check, tpu
from focus_jax.config import MODES, ModelConfig
from focus_jax.models import GEOMETRIES, geometry

NEEDED = re.compile(r"(?:required for HLO temporaries \(|Used )([\d.]+)G")


def target(cfg: ModelConfig, args: argparse.Namespace, batch: int, mode: str = "focus",
           prompts: tuple[int, ...] = ()) -> compile_check.Target:
    ladder = tuple(float(f) for f in args.bucket_ladder.split(","))
    return compile_check.make_target(
        cfg, args.topology, slots=batch, positions=args.max_len, mesh=args.mesh,
        prompt_lengths=prompts,
        generation=GenerationConfig(mode=mode, kernels=args.kernels, bucket_ladder=ladder))


def needed_bytes(report: compile_check.ProgramReport) -> float | None:
    """What the program needs per chip: its total, or what the compiler's refusal names."""
    if report.result.memory is not None:
        return report.needed
    found = NEEDED.search(report.result.error or "")
    return float(found.group(1)) * tpu.GIB if found else None


def decode_round(cfg, args, batch: int, mode: str = "focus") -> compile_check.ProgramReport:
    [report] = compile_check.check(target(cfg, args, batch, mode))
    print(f"  batch {batch:4d} {mode:8s} {compile_check.format_report(report)}", flush=True)
    return report


def full_prefill(cfg, args, batch: int) -> compile_check.ProgramReport:
    """Prefill of prompts as long as the cache (the engine's prefill batch) at ``batch`` slots."""
    [report] = compile_check.check(target(cfg, args, batch, prompts=(args.max_len,)),
                                   decode=False)
    print(f"  batch {batch:4d} {compile_check.format_report(report)}", flush=True)
    return report


def upper_batch(cfg, args) -> int:
    """The largest multiple of the step whose weights and decode state fit the chip."""
    hbm, batch = target(cfg, args, args.step).hbm_bytes, args.step
    while compile_check.resident(target(cfg, args, batch + args.step)).total < hbm:
        batch += args.step
    return batch


def largest_batch(cfg: ModelConfig, args: argparse.Namespace, compile_at, upper: int):
    """The largest multiple of ``args.step`` up to ``upper`` whose program (``compile_at(batch)``
    gives its report) fits, and its report; ``(None, None)`` when none does.

    A fit costs minutes of compilation and a refusal seconds, so candidates come from above:
    while nothing fits, where the memory the last refusal needed, taken as the weights plus a
    part proportional to the batch, meets the chip's HBM; once something fits, one step below
    the smallest refusal (which either fits, ending the search, or is refused in seconds).
    """
    step, hbm = args.step, target(cfg, args, args.step).hbm_bytes
    weights = compile_check.resident(target(cfg, args, step)).weights
    fit, fit_report, refused, batch = 0, None, upper + step, upper
    while refused - fit > step:
        report = compile_at(batch)
        if report.fits:
            fit, fit_report = batch, report
            batch = refused - step
            continue
        needed = needed_bytes(report)
        if needed is None:
            raise SystemExit(f"the program does not compile: {report.result.error}")
        refused = batch
        estimate = int((hbm - weights) / ((needed - weights) / batch)) // step * step
        if not fit and estimate < step:
            break
        batch = refused - step if fit else max(step, min(estimate, refused - step))
    return (fit, fit_report) if fit else (None, None)


def longest_prefill(cfg, args, batch: int) -> tuple[int | None, compile_check.ProgramReport]:
    """The longest prompt bucket whose prefill (the engine's prefill batch) fits."""
    buckets = compile_check.make_target(
        cfg, args.topology, slots=batch, positions=args.max_len, mesh=args.mesh,
        generation=GenerationConfig(kernels=args.kernels)).prompt_buckets
    for length in sorted(buckets, reverse=True):
        [report] = compile_check.check(target(cfg, args, batch, prompts=(length,)), decode=False)
        print(f"  {compile_check.format_report(report)}", flush=True)
        if report.fits:
            return length, report
    return None, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), required=True)
    parser.add_argument("--topology", required=True)
    parser.add_argument("--mesh", default=None)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--step", type=int, default=8, help="batch granularity")
    parser.add_argument("--bucket-ladder", default="0.5,1",
                        help="short ladder: memory is set by the largest bucket, compile time "
                             "by the number of buckets")
    parser.add_argument("--kernels", choices=("pallas_tpu", "xla"), default=None)
    parser.add_argument("--prefill-at", type=int, default=None, metavar="BATCH",
                        help="skip the decode rounds: only the prefill searches, at BATCH slots "
                             "(the decode round's largest, from an earlier run)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cfg = geometry(args.geometry, "bfloat16")
    print(compile_check.describe(target(cfg, args, args.step)).splitlines()[0], flush=True)
    batch, rows = args.prefill_at, []
    if batch is None:
        batch, focus = largest_batch(cfg, args, lambda b: decode_round(cfg, args, b),
                                     upper_batch(cfg, args))
        if batch is None:
            print("no batch fits")
            return
        rows = mode_rows(cfg, args, batch, focus)
    rows.append(prefill_row(cfg, args, batch))
    print(json.dumps(rows[-1]), flush=True)
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps(old + rows, indent=1) + "\n")


def row_key(args: argparse.Namespace) -> dict:
    return {"date": datetime.date.today().isoformat(), "geometry": args.geometry,
            "topology": args.topology, "mesh": args.mesh or "data=1,model=1",
            "kernels": args.kernels or compile_check.TPU_KERNELS,
            "bucket_ladder": args.bucket_ladder, "max_len": args.max_len}


def mode_rows(cfg, args, batch: int, focus: compile_check.ProgramReport) -> list[dict]:
    """One row per mode: its decode round compiled at ``batch``."""
    rows = []
    for mode in MODES:
        report = focus if mode == "focus" else decode_round(cfg, args, batch, mode)
        t = target(cfg, args, batch, mode)
        largest, smallest = compile_check.decode_flops_range(t)
        memory = report.result.memory
        rows.append({
            **row_key(args), "program": "decode round", "mode": mode, "batch": batch,
            "fits": report.fits, "error": report.result.error,
            "compile_seconds": report.result.seconds,
            "compile_cpu_seconds": report.result.cpu_seconds,
            "hbm_gib": t.hbm_bytes / tpu.GIB,
            "arguments_gib": memory and memory.arguments / tpu.GIB,
            "temporaries_gib": memory and memory.temporaries / tpu.GIB,
            "outputs_gib": memory and memory.outputs / tpu.GIB,
            "total_gib": memory and report.needed / tpu.GIB,
            "step_tflops_largest_bucket": largest / 1e12,
            "step_tflops_smallest_bucket": smallest / 1e12,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def prefill_row(cfg, args, batch: int) -> dict:
    """Prefill next to a decode state of ``batch`` slots: the longest prompt bucket that fits,
    and the largest batch at which prompts as long as the cache do."""
    length, prefill = longest_prefill(cfg, args, batch)
    full_batch, full = largest_batch(cfg, args, lambda b: full_prefill(cfg, args, b), batch)
    return {**row_key(args), "program": "prefill", "batch": batch,
            "prefill_batch": target(cfg, args, batch).prefill_batch,
            "longest_prefill_bucket": length,
            "prefill_total_gib": prefill.needed and prefill.needed / tpu.GIB,
            "prefill_compile_seconds": prefill.result.seconds,
            "batch_with_full_prefill": full_batch,
            "full_prefill_total_gib": full and full.needed / tpu.GIB,
            "full_prefill_compile_seconds": full and full.result.seconds}


if __name__ == "__main__":
    main()
