"""Plot ragged-attention times per path from `scripts/benchmark_kernels.py --json` output.

    python scripts/plot_kernels.py docs/data/kernels_attention_h200_2026-11-30.json --out docs/kernels.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PATHS = (("triton", "Triton (ours)"), ("cudnn", "cuDNN, padded"), ("xla", "XLA reference, padded"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.file) as f:
        rows = json.load(f)["ragged_attention"]
    panels = sorted({(r["slots"], r["kv_len"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels) // 2, figsize=(3.0 * len(panels) // 2, 5.4),
                             sharex=True, squeeze=False)
    for ax, (slots, kv_len) in zip(axes.flat, panels, strict=True):
        cases = sorted((r for r in rows if (r["slots"], r["kv_len"]) == (slots, kv_len)),
                       key=lambda r: r["retained"])
        for key, label in PATHS:
            ax.plot([100 * r["retained"] for r in cases], [r[key + "_ms"] for r in cases],
                    marker="o", markersize=3, label=label)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{slots} slots, kv_len {kv_len}", fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("rows retained (%)")
    for ax in axes[:, 0]:
        ax.set_ylabel("ms (median)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Ragged attention, SDAR-8B shapes, one H200", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
