# Sourced by the device scripts: the carried wheels installed, the environment, the clock.
T0=$(date +%s)
BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
at() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > /tmp/pip.log 2>&1 || { tail /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:.whl/stub:$PWD
export FOCUS_JAX_CACHE_DIR=/tmp/fjcache
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/env.txt"
echo "cores $(nproc) commit $(git rev-parse --short HEAD 2>/dev/null)" >> "$OUT/env.txt"
cat "$OUT/env.txt"
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LADDER8=0.0625,0.125,0.1875,0.25,0.375,0.5,0.75,1.0
B="python3 -m focus_jax.cli bench"
