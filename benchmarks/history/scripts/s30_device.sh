#!/bin/bash
# The next device call after session 29 (one `run` on an H100 or H200, <= 9.7 min, a short table last):
# 1. compiled tests: the chain kernel in place on the state cache (tests/test_chain_in_place.py:
#    the compose program as one kernel), the chain kernel, the GDN decode kernels;
# 2. rag at 16 seats, its compose program profiled in place and, same process, in the form before
#    (COMPOSE_IN_PLACE=0: 53 kernels, 1.05 ms = 11.05% of its warm step on an H100 in s28b);
# 3. the 64-seat 128-token prefill and decode steps (8 logits rows each): the general decode
#    form, today's (the GDN layer per sequence, its conv read straight from the state:
#    DECODE_SEQ_ROWS), and today's with the LM head's rows padded to 64 (PAD_LOGITS_ROWS: the
#    head alone 1.8x at 8 rows, s29d), one process, profiled;
# 4. the plain 1,024-token step's conv taps as one stacked gather each (CONV_STACKED_GATHER, the
#    span steps' form: their conv fusion < 0.29 ms a step, the plain one's 0.68) against today's;
# 5. the LM head alone at 8-32 rows, as stored and padded to 64, with its kernels and busy time
#    (s29d: 8 / 16 rows 0.65 / 0.87 ms as stored, 0.36 / 0.37 padded; kernels not counted then);
# 6. issue 29's span request (its reordered call's decodes take both changes), if time is left.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s30_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s29
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s30.txt
left() { echo $((${TOTAL:-570} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 110 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_chain_in_place.py tests/test_chain_compose_kernel.py tests/test_gdn_decode_kernel.py \
  tests/test_decode_conv.py tests/test_logits_rows.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200 >> "$R"
OUT=$OUT LIMIT=130 bash benchmarks/runs/rag16_device.sh >> "$R"
timeout 140 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 --ckpt 1 --decode --reps 9 --profile 6 \
  --forms DECODE_SEQ_ROWS=0,DECODE_CONV_DIRECT=0 "" PAD_LOGITS_ROWS=1 > "$OUT/decode_ab.txt" 2>&1
echo "decode A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time |^profile (decode|prefill) [^|]*:" "$OUT/decode_ab.txt" | cut -c1-170 >> "$R"
timeout 40 python3 -m benchmarks.lm_head_forms --rows 8 16 32 --reps 20 --forms rows64 \
  > "$OUT/lm_head.txt" 2>&1
echo "lm_head_forms rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^rows" "$OUT/lm_head.txt" | cut -c1-150 >> "$R"
timeout 100 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
  --variants plain --forms new conv_stacked --profile 8 > "$OUT/steps.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps.txt" >> "$R"
L=$(left); [ "$L" -gt 330 ] && L=330
OUT=$OUT LIMIT=$L EXTRA="--profile-top 15" bash benchmarks/runs/span_request_device.sh >> "$R"
grep -E "^profile" "$OUT/hybrid_spans.txt" | cut -c1-160 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
