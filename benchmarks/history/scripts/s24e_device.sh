#!/bin/bash
# The next device call after session 24 (one `run`, <= 9.5 min, a short table last; raw files
# under $OUT), timing what session 24 built after its last call: a chunk that only enters with
# cached maps runs the plain step, and Qwen3.5's fused projections (fuse_params: 96 fewer GEMMs
# a step). 1. issue 29's span request at the default engine (goal table; the reordered call's
# step should be `plain+compose`); 2. the plain prefill and decode steps at 64 seats with
# fuse_weights off / on, profiled; 3. rag at 16 seats (pic_off vs fcfs, the compose program).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s24e_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s24
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s24e.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=300 bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); [ "$L" -gt 130 ] && L=130
if [ "$L" -ge 60 ]; then
  timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
    --tokens 128 1024 --reps 10 --decode --fuse-weights 0 1 --ckpt 1 --profile 8 \
    > "$OUT/fixed_step.txt" 2>&1
  echo "fixed step rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "ms/step|kernels, busy" "$OUT/fixed_step.txt" | cut -c1-200 >> "$R"
fi
L=$(left); [ "$L" -gt 150 ] && L=150
if [ "$L" -ge 70 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
