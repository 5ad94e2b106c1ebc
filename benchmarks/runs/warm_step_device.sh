#!/bin/bash
# Issue 29, one H100/H200 call (~2-4 min, fresh compile cache): GPU ms per step of the hybrid step
# variants at rag's shape (T = 1,024 rows, S = 16 sequences, qwen3_5_0_8b bf16, its real GDN
# kernels): span, warm/0 (a warm step capturing and continuing nothing: the common one) and
# warm/4, interleaved over ROUNDS rounds (each a fresh process: compile, then the median of REPS
# steps). The warm/0 - span gap is what a warm step's capture machinery costs when it captures
# nothing (benchmarks/span_step_work.py counts it on the CPU). Run it on the tree before and after
# a change (same machine) to time the change. CPU check (~1 min):
#   PYTHON=/work/main/.venv/bin/python JAX_PLATFORMS=cpu MODEL=tiny_qwen3_5 ROUNDS=1 REPS=2 \
#   OUT=/tmp/warm_dev bash benchmarks/runs/warm_step_device.sh
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/warm_step.txt; T0=$SECONDS
{ git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null; } > "$R" 2>&1
for round in $(seq ${ROUNDS:-2}); do
  for v in span warm/0 warm/4; do
    timeout ${LIMIT:-120} ${PYTHON:-python3} -m benchmarks.span_step_work --time ${MODEL:-qwen3_5_0_8b} \
      --dtype bfloat16 --variants $v --reps ${REPS:-20} >> "$R" 2>&1
    echo "round $round $v rc=$? t=$((SECONDS-T0)) s" >> "$R"
  done
done
grep "ms/step\|rc=[^0]" "$R"
