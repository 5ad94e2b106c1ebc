#!/bin/bash
# Session 24's device call after Config.small_seq_bucket (one `run`, <= 9.5 min, a short table
# last; raw files under $OUT): issue 29's span request at the default engine (the small sequence
# bucket on: its one-request steps run with S = 8, not 64; compare s23.txt of the call before),
# the plain prefill and decode steps at 64 seats with the small bucket off / on (t = 128, 1,024),
# then rag at 16 seats (pic_off vs fcfs: steps of <= 8 sequences now run with S = 8 too).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s24c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s24
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s24c.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
{ git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null; } > "$R" 2>&1
OUT=$OUT LIMIT=330 bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
if [ "$L" -ge 60 ]; then
  timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
    --tokens 128 1024 --reps 10 --decode --small-seq-bucket 0 8 --profile 12 \
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
