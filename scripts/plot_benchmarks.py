"""Plot throughput per mode, as speed-up over baseline, from `scripts/benchmark.py --json` files.

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
    for r in rows:
        r["model"] = r["model"].removeprefix("checkpoints/")
    groups = sorted({(r["model"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 3.6))
    width = 0.8 / len(MODES)
    def throughput(group, mode):
        return next((r["tokens_per_second"] for r in rows
                     if (r["model"], r["batch"]) == group and r["mode"] == mode), 0.0)

    # Bars: speed-up over baseline (models differ by 100x in tokens/s); labels: tokens/s.
    for i, mode in enumerate(MODES):
        values = [throughput(g, mode) for g in groups]
        ratios = [v / max(throughput(g, "baseline"), 1e-9) for g, v in zip(groups, values, strict=True)]
        bars = ax.bar([x + (i - 1) * width for x in range(len(groups))], ratios, width, label=mode)
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_ylabel("output tokens/s over baseline\n(labels: tokens/s)")
    ax.set_title("one H200, greedy (sdar-*: random weights, block 32; focus-tiny: trained, block 8)",
                 fontsize=9)
    ax.set_ylim(0, 1.15 * ax.get_ylim()[1])
    ax.legend(loc="upper left", fontsize=8, ncols=3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
