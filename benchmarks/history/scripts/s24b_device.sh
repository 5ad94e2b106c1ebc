#!/bin/bash
# Session 24's second device call (one `run`, ~3 min): where a small hybrid step's time goes at the
# default engine's 64 seats (issue 29's reordered span request: its 121-token warm step, t = 128
# s = 64, took 22.9 ms on the H200, as much as a 1,024-token step; its decode steps 3.3 ms). The
# plain prefill step and the decode step after it at t = 128 / 1,024, 64 and 8 seats,
# max_model_len 25,600, each profiled kernel by kernel (fixed_step_work --time --decode --profile).
# usage: OUT=$OUT bash benchmarks/history/scripts/s24b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/seats_profile.txt
{ git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null; } > "$R" 2>&1
for seats in ${SEATS:-64 8}; do
  timeout ${LIMIT:-120} python3 -m benchmarks.fixed_step_work --time --seats $seats \
    --max-model-len 25600 --tokens ${TOKENS:-128 1024} --reps 10 --decode --profile 16 \
    >> "$R" 2>&1
  echo "seats=$seats rc=$? t=$((SECONDS-T0)) s" >> "$R"
done
grep -E "ms/step|kernels, busy|rc=" "$R"
