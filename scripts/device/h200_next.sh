#!/bin/bash
# The next H200 call (planned 2026-12-08, not yet run): needs scripts/device/wheels.sh first;
#     run(command="bash scripts/device/h200_next.sh 550", carry=[".whl", ".peer"], needs_h200=True)
# H200: issue 35's server start (SDAR-8B, 256 x 2048, cold then warm); issue 39's FP8 focus with
# FP8 activations from 1,024 rows against bf16 focus (SDAR-8B, batch 256, 64 new tokens).
BUDGET=${1:-570}
source scripts/device/common.sh
set -u
JAX_PLATFORMS=cuda timeout 90 python3 -m pytest -q -m gpu tests/test_grouped_matmul.py -k 8_bit -rs > "$OUT/gmm8.log" 2>&1
at "gmm 8-bit tests rc $?"; tail -6 "$OUT/gmm8.log" | cut -c1-300
SLOTS=256; [ "$MEM" -lt 100000 ] && SLOTS=128
python3 .peer/make_random_sdar.py --geometry sdar-8b --out /tmp/sdar8b > "$OUT/make.log" 2>&1 \
    || { tail "$OUT/make.log"; exit 1; }
at "folder made"
timeout 230 python3 scripts/benchmark_serve_start.py --timeout 140 --json "$OUT/serve_start.json" -- \
    --model /tmp/sdar8b --max-batch $SLOTS --max-model-len 2048 > "$OUT/serve_start.log" 2>&1
at "serve start rc $?"; cut -c1-400 "$OUT/serve_start.log" | tail -8
rm -rf /tmp/sdar8b
F="$B --geometry sdar-8b --batches $SLOTS --modes focus --max-new-tokens 64"
FP8="--quantize fp8 --quantize-activations-from 1024"
T=$(( $(left) - 100 )); [ $T -gt 200 ] && T=200
[ $T -gt 60 ] || exit 0
timeout $T $F --compile-only > "$OUT/fill_bf16.log" 2>&1 &
timeout $T $F $FP8 --compile-only > "$OUT/fill_fp8.log" 2>&1 &
wait; at "filled"; tail -2 "$OUT/fill_bf16.log" "$OUT/fill_fp8.log" | cut -c1-300
for q in bf16 fp8; do
  T=$(( $(left) - 5 )); [ $T -lt 30 ] && break
  Q=""; [ $q = fp8 ] && Q="$FP8"
  timeout $T $F $Q --json "$OUT/sdar8b_focus_$q.json" > "$OUT/sdar8b_$q.log" 2>&1
  at "sdar8b focus $q rc $?"; grep -v -e "^\s*$" -e cuda_timer "$OUT/sdar8b_$q.log" | cut -c1-400 | tail -4
done
