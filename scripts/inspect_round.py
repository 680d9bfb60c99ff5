"""Memory of the compiled decode round, and the large buffers its optimized HLO creates.

    python scripts/inspect_round.py --geometry sdar-1.7b --slots 32 --cache-len 1088 --mode focus

Prints ``memory_analysis()`` and every instruction of the optimized HLO whose result is at least
``--min-gib`` (default: a quarter of one KV-cache array), except the ones that merely update or
pass on a buffer in place. A copy of the KV cache shows up here with the source line that
caused it.
"""

from __future__ import annotations

import argparse
import re

import numpy as np

from focus_jax import bench
from focus_jax.config import GenerationConfig
from focus_jax.engine import Engine

IN_PLACE = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
            "dynamic-update-slice", "scatter", "custom-call", "opt-barrier"}
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
SHAPE = re.compile(r"= (\w+)\[([\d,]*)\]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="sdar-1.7b")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--cache-len", type=int, default=1088)
    parser.add_argument("--mode", default="focus")
    parser.add_argument("--min-gib", type=float, default=None)
    parser.add_argument("--hlo", help="also write the optimized HLO here")
    args = parser.parse_args()

    model = bench.random_model(args.geometry)
    config = GenerationConfig(mode=args.mode, block_size=32, max_new_tokens=32, stop_token_ids=())
    engine = Engine(model, config, slots=args.slots, cache_len=args.cache_len)
    compiled = engine.lower_round().compile()
    print(compiled.memory_analysis())
    cache_bytes = engine.state.cache.k.nbytes
    print(f"one KV-cache array: {cache_bytes / 2**30:.2f} GiB {engine.state.cache.k.shape}")
    threshold = (args.min_gib * 2**30) if args.min_gib else cache_bytes / 4
    text = compiled.as_text()
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(text)
    for line in text.splitlines():
        match = SHAPE.search(line)
        if not match or match.group(1) not in BYTES:
            continue
        dims = [int(d) for d in match.group(2).split(",") if d]
        size = BYTES[match.group(1)] * int(np.prod(dims, dtype=np.int64))
        opcode = line.split("=", 1)[1].split("(", 1)[0].split()[-1]
        if size >= threshold and opcode not in IN_PLACE:
            print(f"{size / 2**30:7.2f} GiB  {line.strip()[:400]}")


if __name__ == "__main__":
    main()
