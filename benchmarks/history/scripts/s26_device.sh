#!/bin/bash
# The next device call after session 25 (one `run`, <= 9.5 min, a short table last; raw files
# under $OUT): what session 25 built and could not time. 1. compiled tests of the in-place GDN
# decode kernel (gated_delta/decode_triton.py); 2. that kernel against the XLA decode step at
# Qwen3.5-0.8B's layer shapes (8 and 64 rows, block_v sweep); 3. the 64-seat decode step with
# the GDN decode as before / in place / with the layer's glue / and its conv (fixed_step_work
# --decode-in-place 0 1 2 3), profiled; 4. issue 29's span request with the in-place forms
# whose compiled tests passed; 5. if time is left, the prefill steps with the live key
# pre-rotation off / on (session 25's A/B timed one form twice).
# If the in-place decode wins, flip qwen3_5.GDN_DECODE_IN_PLACE to True (one line).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s26_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s26
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s26.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_gdn_decode_kernel.py -k "not engine" > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
for rows in 8 64; do
  timeout 45 python3 -m benchmarks.gdn_decode_bench --rows $rows --block-v 32 64 128 \
    >> "$OUT/gdn_decode.txt" 2>&1
done
echo "gdn decode bench t=$((SECONDS-T0)) s" >> "$R"
grep -E "gdn decode|in place|layer:|Error" "$OUT/gdn_decode.txt" | cut -c1-160 >> "$R"
timeout 170 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 --reps 20 --decode --decode-in-place 0 1 2 3 --ckpt 1 --profile 6 \
  > "$OUT/fixed_step_decode.txt" 2>&1
echo "fixed step (decode) rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "decode t=|live_prerotate" "$OUT/fixed_step_decode.txt" | cut -c1-200 >> "$R"
L=$(left); [ "$L" -gt 170 ] && L=170
if [ "$L" -ge 100 ]; then
  # the forms whose compiled tests passed: conv, else glue, else the kernel alone
  T=$OUT/tests.txt; GLUE=True; CONV=True; ON=True
  grep -q "^FAILED.*decode_conv_layer" $T && CONV=False
  grep -q "^FAILED.*decode_layer_in_place" $T && GLUE=False && CONV=False
  grep -q "^FAILED.*decode_in_place_matches" $T && ON=False
  grep -q " passed" $T || ON=False
  echo "span request with GDN_DECODE_IN_PLACE=$ON GLUE=$GLUE CONV=$CONV" >> "$R"
  OUT=$OUT LIMIT=$L PRE="from minipic_jax.models import qwen3_5
qwen3_5.GDN_DECODE_IN_PLACE, qwen3_5.GDN_DECODE_GLUE, qwen3_5.GDN_DECODE_CONV = $ON, $GLUE, $CONV" \
    bash benchmarks/runs/span_request_device.sh >> "$R"
fi
L=$(left); [ "$L" -gt 110 ] && L=110
if [ "$L" -ge 60 ]; then
  timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
    --tokens 128 1024 --reps 10 --live-prerotate 0 1 --ckpt 1 --profile 6 \
    > "$OUT/fixed_step_prefill.txt" 2>&1
  echo "fixed step (prefill) rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "ms/step|kernels, busy|live_prerotate" "$OUT/fixed_step_prefill.txt" | cut -c1-200 >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
