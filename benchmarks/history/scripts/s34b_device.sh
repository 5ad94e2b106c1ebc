#!/bin/bash
# Session 34's second device call (one `run`, <= 7.5 min, a short table last), after s33b's
# turned the span finals in place (FINALS_IN_PLACE) and the stream's gather by a kernel
# (stream_pack.PACK_KERNEL) on:
# 1-2. s34c_device.sh: the compiled engine tests with both on (and those owed since session 31),
#    then the state scan's sweep (SCAN_BLOCK_V, SEQ_STRIDE) at rag's 1,024 tokens x 16 seats;
# 3. rag at 16 seats (pic_off, fcfs) with today's defaults and --compose-cost 1 (the compose
#    program's share of its step, pipelined as the engine runs it: the composition goal).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s34b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s34b.txt
left() { echo $((${TOTAL:-450} - SECONDS + T0)); }
OUT=$OUT TOTAL=290 bash benchmarks/history/scripts/s34c_device.sh > /dev/null 2>&1
cat "$OUT/s34c.txt" > "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
[ "$L" -ge 80 ] && OUT=$OUT LIMIT=$L NAME=rag_s34 bash benchmarks/runs/rag16_device.sh >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
