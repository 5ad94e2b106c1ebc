#!/bin/bash
# Session 39's third call (one `run`, <= 9.5 min, any card): rag at 16 seats (pic_off vs fcfs,
# multi and zipf: issue 29's goal) with today's tree, with session 38's tree as it ran in its
# s38c call (3c45bed, whose zipf fcfs was 1.083x pic_off; session 39's second call had 0.900x
# with today's tree on another host), then today's again: code or host? The old tree travels as
# an untracked copy (`git archive 3c45bed | tar -x -C old3c45bed`).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s39d_device.sh
set -u; T0=$SECONDS
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s39d.txt
left() { echo $((${TOTAL:-450} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
rag() {  # $1: name, $2: tree
  local L; L=$(left); [ "$L" -gt 110 ] && L=110
  [ "$L" -lt 70 ] && { echo "$1: skipped (time)" >> "$R"; return; }
  (cd "$2" && PYTHONPATH=$PWD OUT=$OUT LIMIT=$L NAME=$1 COMPOSE=0 CONFIGS="pic_off fcfs" \
    bash benchmarks/runs/rag16_device.sh | grep " rc=" >> "$R")
  grep -E "Throughput|span maps|offline [0-9.]+x" "$OUT/$1.txt" | sed -E \
    "s/, [0-9.]+ total tokens.*hit rate/, hit rate/; s/prompt.*TTFT/TTFT/" | cut -c1-150 >> "$R"
}
rag rag_new1 "$PWD"
rag rag_old "$PWD/old3c45bed"
rag rag_new2 "$PWD"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
