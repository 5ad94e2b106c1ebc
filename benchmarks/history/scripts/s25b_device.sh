#!/bin/bash
# Session 25's second code call (one `run`, <= 9.5 min, a short table last; raw files under $OUT):
# a layer's checkpoint states computed before its states are written back (qwen3_5.
# CHECKPOINTS_FIRST) and stored per layer (checkpoint_pool.PER_LAYER_STORE): the s25a HLO of the
# t = 128 step copied 7 layers' [65, 16, 128, 128] state caches twice (memcpy128 x 14, 0.65 ms)
# and transposed the stacked checkpoints (input_transpose_fusion, 0.36 ms). 1. compiled engine
# tests of the hybrid cache; 2. plain prefill t = 128 / 1,024 at 64 seats, new vs old form,
# profiled; 3. the new form's HLO (copies left); 4. issue 29's span request; 5. rag at 16 seats.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s25b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s25
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s25b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
  tests/test_engine_hybrid_cache.py tests/test_hybrid_checkpoint_rows.py \
  tests/test_small_seq_bucket.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
timeout 130 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 1024 --reps 10 --ck-forms old new --ckpt 1 --profile 10 \
  > "$OUT/fixed_step.txt" 2>&1
echo "fixed step rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "ms/step|kernels, busy|ck_form|memcpy|transpose_fusion |concatenate_fusion_1" "$OUT/fixed_step.txt" | cut -c1-200 >> "$R"
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
