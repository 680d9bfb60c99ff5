#!/bin/bash
# One GPU device call, in order of priority, each step cut to fit SECONDS_LEFT (default 560):
#   1. issue 35: `focus-jax serve` at SDAR-8B geometry, 256 slots x 2048 positions, cold then warm
#      (scripts/benchmark_serve_start.py; the folder drawn by the LMDeploy peer's make_random_sdar.py);
#   2. issue 36: the grouped matmul's tile configs tuned at 65,536 and 8,192 rows (the table for
#      pallas_kernels/grouped_matmul/tuned/<device kind>.json comes back as $OUT/table.json);
#   3. the decode round's compile alone, with and without XLA's forced compilation parallelism.
# Needs, in ignored folders carried with the call: .whl/ (jax-triton 0.3.1, tokamax 0.0.17 and the
# wheels it imports, fastapi/starlette/uvicorn; .whl/stub/xprof: a stand-in for the 22 MB xprof,
# which tokamax imports at import time) and .peer/ (../shared/peer without its wheels).
#     bash scripts/h200_startup_and_tuning.sh 560
set -u
T0=$(date +%s)
BUDGET=${1:-560}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/stub:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/env.txt"
nproc >> "$OUT/env.txt"
python3 .peer/make_random_sdar.py --geometry sdar-8b --out /tmp/sdar8b > "$OUT/make.log" 2>&1 \
    || { tail "$OUT/make.log"; exit 1; }
echo "folder made at $(( $(date +%s) - T0 )) s"
# 256 slots x 2048 positions of SDAR-8B KV (77 GB) and its weights (16 GB) fit an H200, not an
# 80 GB H100: there the server runs 128 slots.
SLOTS=256
[ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && SLOTS=128
timeout 260 python3 scripts/benchmark_serve_start.py --timeout 200 --json "$OUT/serve_start.json" -- \
    --model /tmp/sdar8b --max-batch $SLOTS --max-model-len 2048 > "$OUT/serve_start.log" 2>&1
echo "serve start rc $? at $(( $(date +%s) - T0 )) s"; cut -c1-600 "$OUT/serve_start.log"
T=$(( $(left) - 150 )); [ $T -gt 240 ] && T=240
[ $T -gt 40 ] && timeout $T python3 scripts/tune_grouped_matmul.py --rows 65536,8192,16384 --runs 5 \
    --calls 10 --json "$OUT/tune.json" --table "$OUT/table.json" > "$OUT/tune.log" 2>&1
echo "tune rc $? at $(( $(date +%s) - T0 )) s"; tail -25 "$OUT/tune.log"
for flags in "" "--xla_gpu_force_compilation_parallelism=16"; do
    T=$(( $(left) - 5 )); [ $T -lt 60 ] && break
    XLA_FLAGS="$flags" timeout $T python3 scripts/compile_round_time.py --geometry sdar-8b --slots 256 \
        --cache-len 2048 --label "flags=$flags" >> "$OUT/round.jsonl" 2>> "$OUT/round.log"
    echo "round compile rc $? at $(( $(date +%s) - T0 )) s"
done
cat "$OUT/round.jsonl" 2>/dev/null
