#!/bin/bash
# Session 38's call (one `run`, <= 9.5 min, any card): first rag at 16 seats with the span
# capture policy (Config.span_maps.capture "auto", the default since: fcfs) against capturing
# every span (fcfs_all, the earlier behaviour) and prefix caching (pic_off), twice (issue 29's
# zipf goal: fcfs >= 1.0x pic_off; CPU counts: zipf's capturing steps 28 -> 16 of 36, the same
# outputs); then s38b_device.sh with the time left (the row kernels' options swept, the decode
# step with them).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s38c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s38c.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
RUNS="1 2"; [ "${TOTAL:-560}" -lt 500 ] && RUNS=1  # a short call: one rag run
for i in $RUNS; do
  L=$(left); L=$((L - 300)); [ "$L" -gt 110 ] && L=110
  [ "$L" -ge 50 ] && OUT=$OUT LIMIT=$L NAME=rag_cap_$i COMPOSE=0 CONFIGS="pic_off fcfs fcfs_all" \
    bash benchmarks/runs/rag16_device.sh | grep " rc=" >> "$R"
  grep -E "^  (fcfs|fcfs_all) |hit rate|span maps" "$OUT/rag_cap_$i.txt" \
    | sed -E "s/, [0-9.]+ total tokens.*hit rate/, hit rate/; s/TTFT.*//" | cut -c1-150 >> "$R"
done
echo "== rag t=$((SECONDS-T0)) s" >> "$R"
OUT=$OUT TOTAL=$(left) bash benchmarks/runs/s38b_device.sh > /dev/null 2>&1
cat "$OUT/s38b.txt" >> "$R" 2>/dev/null
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
