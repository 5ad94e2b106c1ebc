#!/bin/bash
# Session 25's last call (one `run`, <= 5.5 min): the plain prefill steps t = 128 / 1,024 at 64
# seats under the four checkpoint forms (fixed_step_work --ck-forms: s25b's "new" removed the 14
# state-cache copies and the stacked transpose but added 72 kernels; which half pays).
# usage: OUT=$OUT bash benchmarks/history/scripts/s25c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s25
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s25c.txt
nvidia-smi -L > "$R" 2>/dev/null
timeout ${LIMIT:-280} python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 1024 --reps 20 --ck-forms old barrier per_layer new \
  --ckpt 1 --profile 3 > "$OUT/fixed_step.txt" 2>&1
echo "fixed step rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "ms/step|kernels, busy|ck_form" "$OUT/fixed_step.txt" | cut -c1-200 >> "$R"
cat "$R"
