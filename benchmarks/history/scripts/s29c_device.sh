#!/bin/bash
# s30_device.sh cut to the device time session 29 had left (<= 6.5 min, a short table last): compiled tests
# of the in-place chain kernel and the per-sequence GDN decode; rag at 16 seats with the compose
# program in place against the form before (same process); the 64-seat decode step, general form
# against per sequence; the LM head alone in four forms. No span request (s30_device.sh has it).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s29c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s29
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s29c.txt
left() { echo $((${TOTAL:-380} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_chain_in_place.py tests/test_chain_compose_kernel.py tests/test_decode_conv.py \
  tests/test_gdn_decode_kernel.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
L=$(left); [ "$L" -gt 125 ] && L=125
OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
L=$(left); [ "$L" -gt 100 ] && L=100
[ "$L" -ge 40 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 --ckpt 1 --decode --reps 9 --profile 6 \
  --forms DECODE_SEQ_ROWS=0,DECODE_CONV_DIRECT=0 DECODE_SEQ_ROWS=1 > "$OUT/decode_ab.txt" 2>&1
echo "decode A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time .*decode|^profile decode" "$OUT/decode_ab.txt" | cut -c1-170 >> "$R"
L=$(left); [ "$L" -gt 60 ] && L=60
[ "$L" -ge 20 ] && timeout $L python3 -m benchmarks.lm_head_forms --rows 1 8 16 64 --reps 20 \
  > "$OUT/lm_head.txt" 2>&1
echo "lm_head_forms rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^rows" "$OUT/lm_head.txt" | cut -c1-150 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
