"""Plot throughput per mode from benchmark JSON files (scripts/benchmark.py --json).

    python scripts/plot_benchmarks.py docs/data/bench_*.json --out docs/benchmarks.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MODES = ("baseline", "delayed", "focus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for name in args.files:
        with open(name) as f:
            rows += json.load(f)
    groups = sorted({(r["model"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 3.6))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        values = [next((r["tokens_per_second"] for r in rows
                        if (r["model"], r["batch"]) == g and r["mode"] == mode), 0) for g in groups]
        bars = ax.bar([x + (i - 1) * width for x in range(len(groups))], values, width, label=mode)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_ylabel("output tokens / s")
    ax.set_title("H200, random weights, greedy, block 32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
