#!/bin/bash
# Any one GPU: issue 39's tokamax 8-bit tests; LLaDA2.0-mini batch 64 focus, bf16 then int8.
BUDGET=${1:-570}
source carry/common.sh
set -u
timeout 150 python3 -m pytest -q -x -m gpu tests/test_grouped_matmul.py -k 8_bit > "$OUT/gmm8.log" 2>&1
at "gmm 8-bit tests rc $?"; tail -15 "$OUT/gmm8.log" | cut -c1-400
for q in bf16 int8; do
  T=$(( ($(left) - 8) )); [ $q = bf16 ] && T=$(( T / 2 + 20 ))
  [ $T -lt 60 ] && break
  Q=""; [ $q != bf16 ] && Q="--quantize $q"
  timeout $T $B --geometry llada2-mini --batches 64 --max-new-tokens 256 --modes focus $Q \
      --bucket-ladder $LADDER8 --json "$OUT/llada2_bs64_$q.json" > "$OUT/llada2_$q.log" 2>&1
  at "llada2 bs64 $q rc $?"; grep -v "^\s*$" "$OUT/llada2_$q.log" | cut -c1-300 | tail -12
done
