#!/bin/bash
# Session 25's first code call (one `run`, <= 9.5 min, a short table last; raw files under $OUT):
# the Triton ragged kernel's key pre-rotation written only where the kernel reads
# (triton_ragged.rotated_keys -> gather_live; the whole-table form cost 6 x 0.12 ms a step at
# max_model_len 25,600). 1. compiled tests of the two kernels; 2. plain prefill steps t = 128 /
# 1,024 at 64 seats, whole vs live pre-rotation, profiled; 3. the optimized HLO of the t = 128
# step (what its memcpy128 x 14 and input_transpose_fusion copy); 4. issue 29's span request;
# 5. rag at 16 seats.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s25a_device.sh
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
D=/tmp/dump_s25; rm -rf $D
XLA_FLAGS="--xla_dump_to=$D --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step_impl.*" \
  JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s25_dump timeout 90 python3 -m benchmarks.fixed_step_work \
  --time --seats 64 --max-model-len 25600 --tokens 128 --reps 2 --ckpt 1 > "$OUT/dump_run.txt" 2>&1
echo "hlo dump rc=$? t=$((SECONDS-T0)) s: $(ls $D | wc -l) files" >> "$R"
for f in $(ls -S $D/*after_optimizations.txt 2>/dev/null | head -2); do
  echo "== $(basename $f) $(wc -c < $f) bytes" >> "$OUT/hlo_copies.txt"
  grep -E "^\s*(ROOT )?%?(copy|[a-z_]*transpose_fusion|[a-z_]*concatenate_fusion)[.0-9_]* = " $f \
    | grep -vE "= (s32|pred|u32)\[[0-9,]{0,12}\]" | cut -c1-400 >> "$OUT/hlo_copies.txt"
  cp $f "$OUT/" 2>/dev/null
done
grep -cE "copy" "$OUT/hlo_copies.txt" >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
if [ "$L" -ge 100 ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=true timeout $L python3 -m benchmarks.cli hybrid-spans --steps \
    --sync-repeat --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
  echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "^(call|[a-i] )|goal|warm-up|^    (prefill|decode)" "$OUT/hybrid_spans.txt" \
    | cut -c1-200 >> "$R"
fi
L=$(left); [ "$L" -gt 150 ] && L=150
if [ "$L" -ge 70 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
