#!/bin/bash
# Session 25's first code call (one `run`, <= 9.5 min, a short table last; raw files under $OUT):
# the Triton ragged kernel's key pre-rotation written only where the kernel reads
# (triton_ragged.rotated_keys -> gather_live; the whole-table form cost 6 x 0.12 ms a step at
# max_model_len 25,600). 1. compiled tests of the two kernels; 2. plain prefill steps t = 128 /
# 1,024 at 64 seats, whole vs live pre-rotation, profiled; 3. the optimized HLO of the t = 128
# step (what its memcpy128 x 14 and input_transpose_fusion copy); 4. issue 29's span request;
# 5. rag at 16 seats.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s25a_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s25
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s25a.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
  tests/test_paged_attention.py tests/test_gather_live.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
timeout 130 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 1024 --reps 10 --live-prerotate 0 1 --ckpt 1 --profile 10 \
  > "$OUT/fixed_step.txt" 2>&1
echo "fixed step rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "ms/step|kernels, busy|live_prerotate" "$OUT/fixed_step.txt" | cut -c1-200 >> "$R"
OUT=$OUT bash benchmarks/runs/step_hlo_device.sh >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
if [ "$L" -ge 100 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/span_request_device.sh >> "$R"
fi
L=$(left); [ "$L" -gt 150 ] && L=150
if [ "$L" -ge 70 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
