#!/bin/bash
# Session 28's second device call (one `run` with carry [".whl"], <= 7.5 min, a short table
# last): issue 29's rag run at 16 seats (pic_off vs fcfs on multi and zipf) after the step's
# conv as summed taps, the span-map pool's store barrier, spans filling a step and the
# first-span-start break; then the GDN 32K prefill against fla in the same process (goal 0.8x;
# session 26: 0.85x), profiled by part.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s28b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s28b.txt
left() { echo $((${TOTAL:-440} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=250 bash benchmarks/runs/rag16_device.sh >> "$R"
L=$(left)
if [ "$L" -ge 60 ]; then
  timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
    .whl/fla_core*.whl .whl/einops*.whl > /dev/null 2>&1
  PYTHONPATH=$PWD:/tmp/site timeout $L python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 \
    --variants fused fused_mosaic_out --profile > "$OUT/gdn.txt" 2>&1
  echo "gdn rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -v "^W1" "$OUT/gdn.txt" | tail -30 | cut -c1-200 >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
