"""Throughput of the three modes: ``focus-jax bench`` (kept for the commands in docs/).

    python scripts/benchmark.py --geometry sdar-8b --batches 64,128 --max-new-tokens 64 --json out.json
"""

import sys

from focus_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
