#!/bin/bash
# Issue 39: tokamax's int8-weight kernel tuned at LLaDA2.0-mini's expert shapes (rows of batch 64
# focus and baseline), then LLaDA2.0-mini batch 64 focus with int8 experts on the tuned table,
# and bf16 again on the same machine.
BUDGET=${1:-570}
source carry/common.sh
set -u
KIND=$(python3 -c "import jax; print(jax.devices()[0].device_kind.lower().replace(' ', '_'))")
TABLE=pallas_kernels/grouped_matmul/tuned/$KIND.json
timeout 150 python3 scripts/tune_grouped_matmul.py --weights int8 --models llada2.0-mini \
    --rows 4096 --runs 5 --calls 10 --json "$OUT/tune_int8.json" --table "$TABLE" > "$OUT/tune.log" 2>&1
at "tune rc $?"; grep -v '"failed"' "$OUT/tune.log" | cut -c1-250 | tail -8; cp "$TABLE" "$OUT/table.json"
for q in int8; do
  T=$(( $(left) - 8 )); true
  [ $T -lt 60 ] && break
  Q=""; [ $q != bf16 ] && Q="--quantize $q"
  timeout $T $B --geometry llada2-mini --batches 64 --max-new-tokens 256 --modes focus $Q \
      --bucket-ladder $LADDER8 --json "$OUT/llada2_bs64_$q.json" > "$OUT/llada2_$q.log" 2>&1
  at "llada2 bs64 $q rc $?"; grep -v -e "^\s*$" -e cuda_timer "$OUT/llada2_$q.log" | cut -c1-300 | tail -3
done
