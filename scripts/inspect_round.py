"""Memory of the compiled decode round, and the large buffers its optimized HLO creates.

    python scripts/inspect_round.py --geometry sdar-1.7b --slots 32 --cache-len 1088 --mode focus

Prints ``memory_analysis()`` and every instruction of the optimized HLO whose result is at least
``--min-gib`` (default: a quarter of one KV-cache array), except the ones that merely update or
pass on a buffer in place. A copy of the KV cache shows up here with the source line that
caused it.

With ``--quantize`` (docs/quantization.md) it also counts the round's 8-bit products: cuBLASLt
FP8 GEMMs (``__cublas$lt$matmul$f8``), GEMM fusions reading 8-bit operands (the weights
dequantized inside the GEMM), and the instructions that write a whole dequantized layer weight
in the model's dtype (a dequantization XLA did not fuse into its GEMM: a weight read twice) or
in 8 bits in another layout (a transpose cuBLASLt's FP8 GEMM asked for).
"""

from __future__ import annotations

import argparse
import re

import numpy as np
from flax import nnx

from focus_jax import bench
from focus_jax.config import QUANTIZED_TYPES, GenerationConfig, Quantization
from focus_jax.engine import Engine

IN_PLACE = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
            "dynamic-update-slice", "scatter", "custom-call", "opt-barrier"}
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1,
         "f8e4m3fn": 1}
EIGHT_BIT = ("s8[", "f8e4m3fn[")
DTYPES = {"bfloat16": "bf16", "float32": "f32"}
SHAPE = re.compile(r"= (\w+)\[([\d,]*)\]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="sdar-1.7b")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--cache-len", type=int, default=1088)
    parser.add_argument("--mode", default="focus")
    parser.add_argument("--min-gib", type=float, default=None)
    parser.add_argument("--hlo", help="also write the optimized HLO here")
    parser.add_argument("--quantize", choices=QUANTIZED_TYPES, default=None)
    parser.add_argument("--quantize-activations-from", type=int, default=None)
    args = parser.parse_args()

    quantization = (None if args.quantize is None else
                    Quantization(args.quantize, args.quantize_activations_from))
    model = bench.random_model(args.geometry, quantization=quantization)
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
    if quantization is not None:
        print_eight_bit_products(text, model)


def print_eight_bit_products(text: str, model) -> None:
    """The 8-bit GEMMs of the optimized HLO, and any whole layer weight it dequantizes apart."""
    lines = text.splitlines()
    fp8_gemms = [line for line in lines if "__cublas$lt$matmul$f8" in line]
    fused = [line for line in lines if " fusion(" in line and "kind=kCustom" in line
             and any(t in line.split("fusion(", 1)[1] for t in EIGHT_BIT)]
    plain_8bit_dots = [line for line in lines if re.search(r"\bdot\(", line)
                       and sum(line.split("dot(", 1)[1].count(t) for t in EIGHT_BIT) >= 1]
    print(f"cuBLASLt FP8 GEMMs: {len(fp8_gemms)}; GEMM fusions with 8-bit operands: {len(fused)}; "
          f"dots with 8-bit operands left to XLA's own emitter: {len(plain_8bit_dots)}")
    for line in (fp8_gemms + fused)[:12]:
        print("   ", line.strip()[:300])
    layer_weights = {tuple(var.get_value().shape[1:]) for path, var in
                     nnx.to_flat_state(model.params) if path[-1] == "qvalue"}
    fusion_bodies = {name for line in lines if " fusion(" in line
                     for name in re.findall(r"calls=(%[\w.\-]+)", line)}
    dequantized, relaid, body = [], [], None
    for line in lines:
        header = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if header:
            body = header.group(1)
        match = SHAPE.search(line)
        if body in fusion_bodies or not match:
            continue
        dims = tuple(int(d) for d in match.group(2).split(",") if d)
        if line.split("=", 1)[1].split("(", 1)[0].split()[-1] in IN_PLACE:
            continue
        if match.group(1) == DTYPES[model.config.dtype] and dims in layer_weights:
            dequantized.append(line)
        elif (match.group(1) in ("s8", "f8e4m3fn") and dims not in layer_weights
              and any(sorted(dims) == sorted(w) for w in layer_weights)):
            relaid.append(line)
    print(f"layer weights written dequantized ({model.config.dtype}): {len(dequantized)}")
    for line in dequantized[:12]:
        print("   ", line.strip()[:300])
    print(f"8-bit layer weights written in another layout (a transpose for the GEMM): "
          f"{len(relaid)}")
    for line in relaid[:12]:
        print("   ", line.strip()[:300])


if __name__ == "__main__":
    main()
