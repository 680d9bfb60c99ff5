"""Where the decode round slices each layer's weights out of the stack, per weight type.

    JAX_PLATFORMS=cuda python3 scripts/dump_round_weight_slices.py --out /tmp/slices

Compiles the round of ``tests/test_compilation.py::test_gpu_layer_loop_reads_weights_in_place``'s
model (focus mode) with bf16, int8 and FP8 weights; writes each optimized HLO to
``OUT/round_<weights>.hlo.gz`` and prints one line per dynamic slice of a layer weight or scale:
the weight type, the computation it sits in (``%dynamic-slice-fusion...``: read in place by the
GEMM; a loop fusion such as ``%fused_multiply...``: copied, e.g. dequantized) and the slice,
then per weight type how many slices sit in each kind of computation. ``--triton-gemm`` compiles
with XLA's Triton GEMM fusions on (``compilation.GPU_COMPILER_OPTIONS`` turns them off).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path

from focus_jax import Engine, GenerationConfig, compilation, quant
from focus_jax.testing import tiny_model

SLICED = ("s8[1,", "f8e4m3fn[1,", "bf16[1,")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the HLO files")
    parser.add_argument("--triton-gemm", action="store_true",
                        help="XLA's Triton GEMM fusions on")
    parser.add_argument("--weights", default="bf16,int8,fp8", help="comma-separated types")
    args = parser.parse_args()
    if args.triton_gemm:
        compilation.GPU_COMPILER_OPTIONS["xla_gpu_enable_triton_gemm"] = True
    args.out.mkdir(parents=True, exist_ok=True)
    for weights in args.weights.split(","):
        model = tiny_model(seed=0, num_layers=4, hidden_size=256, intermediate_size=512,
                           num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
        model = model if weights == "bf16" else quant.quantize(model, weights)
        config = GenerationConfig(mode="focus", block_size=8, max_new_tokens=8, stop_token_ids=())
        text = Engine(model, config, slots=8, cache_len=128).lower_round().compile().as_text()
        with gzip.open(args.out / f"round_{weights}.hlo.gz", "wt") as f:
            f.write(text)
        computation, kinds = "", collections.Counter()
        for line in text.splitlines():
            if line and not line[0].isspace() and "{" in line:
                computation = line.split()[0]
            if " dynamic-slice(" in line and any(t in line for t in SLICED):
                print(weights, computation[:60], line.strip()[:200])
                kinds[re.sub(r"[._]?\d.*$", "", computation)] += 1
        print(weights, "slices per computation kind:", dict(kinds), flush=True)


if __name__ == "__main__":
    main()
