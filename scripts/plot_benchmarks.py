"""Plot throughput per mode, as speed-up over baseline, from `scripts/benchmark.py --json` files.

    python scripts/plot_benchmarks.py docs/data/bench_*.json --out docs/benchmarks.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from focus_jax.engine import token_layer_split

MODES = ("baseline", "delayed", "focus")
# Layer counts of runs whose JSON predates the "num_layers" field.
LAYERS = {"sdar-8b": 36, "sdar-1.7b": 28, "focus-tiny": 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="one H200, greedy (sdar-*: random weights, block 32; "
                                           "focus-tiny: trained, block 8)")
    args = parser.parse_args()
    rows = []
    for name in args.files:
        with open(name) as f:
            rows += json.load(f)
    for r in rows:
        r["model"] = r["model"].removeprefix("checkpoints/")
    groups = sorted({(r["model"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(5.5, 1.6 + 1.4 * len(groups)), 3.8))
    width = 0.8 / len(MODES)
    def row(group, mode):
        return next((r for r in rows if (r["model"], r["batch"]) == group and r["mode"] == mode),
                    None)

    def throughput(group, mode):
        r = row(group, mode)
        return r["tokens_per_second"] if r else 0.0

    def token_layers(r):
        layers = r.get("num_layers") or LAYERS[r["model"]]
        return sum(token_layer_split(r["processed_per_step"], r["retained_per_step"], layers))

    # Bars: speed-up over baseline (models differ by 100x in tokens/s); labels: tokens/s.
    # Black ticks: the ideal speed-up from token-layers per step (baseline's over the mode's).
    for i, mode in enumerate(MODES):
        xs = [x + (i - 1) * width for x in range(len(groups))]
        values = [throughput(g, mode) for g in groups]
        ratios = [v / max(throughput(g, "baseline"), 1e-9) for g, v in zip(groups, values, strict=True)]
        bars = ax.bar(xs, ratios, width, label=mode)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in values], fontsize=7)
        for x, g in zip(xs, groups, strict=True):
            r, base = row(g, mode), row(g, "baseline")
            if r and base and mode != "baseline":
                ideal = token_layers(base) / token_layers(r)
                ax.hlines(ideal, x - width / 2, x + width / 2, colors="black", linewidth=2,
                          label="ideal (token-layers)" if (i, x) == (2, xs[0]) else None)
    ax.set_xticks(range(len(groups)), [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_ylabel("output tokens/s over baseline\n(labels: tokens/s)")
    ax.set_title(args.title, fontsize=9)
    ax.set_ylim(0, 1.15 * ax.get_ylim()[1])
    ax.legend(loc="upper left", fontsize=7, ncols=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
