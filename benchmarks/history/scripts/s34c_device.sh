#!/bin/bash
# Session 34's last device call (one `run`, <= 5 min): s34b_device.sh's first two parts, cut to
# what the session's device time left holds:
# 1. compiled, with FINALS_IN_PLACE and the pack kernel on: the hybrid span engine against the
#    float64 reference (test_engine_hybrid_spans, test_engine_span_forms) and the engine tests
#    owed since session 31 (GDN_FINALS_IN_PLACE, DECODE_GATES_IN_PROJ through LLM.generate);
#    the pack kernel's own tests (it reads through stream_rows.RowsRef since session 34's review);
# 2. the state scan's value block (ragged.SCAN_BLOCK_V: 64 / 128 against today's 16) and its
#    programs walking every P-th sequence (ragged_triton.SEQ_STRIDE: 32 / 16 against one a
#    sequence) at rag's 1,024 tokens x 16 seats, warm/4 and plain, the 30 costliest kernels.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s34c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s34
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s34c.txt
left() { echo $((${TOTAL:-290} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 140 python3 -m pytest -q -p no:cacheprovider \
  -o addopts= -rfE -n 4 tests/test_engine_hybrid_spans.py tests/test_engine_span_forms.py \
  "tests/test_finals_in_place.py" "tests/test_gdn_decode_kernel.py" -k "engine or span" \
  > "$OUT/tests_s34c.txt" 2>&1
echo "compiled engine tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s34c.txt" | cut -c1-120)" >> "$R"
MINIPIC_COMPILED=1 timeout 45 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_stream_pack.py >> "$OUT/tests_s34c.txt" 2>&1  # (the kernel changed after s34a)
echo "compiled pack kernel tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s34c.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s34c.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); [ "$L" -gt 140 ] && L=140
F="new bv64 stride32"; [ "$L" -ge 90 ] && F="new bv64 bv128 stride32 stride16"
[ "$L" -ge 35 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 5 --variants warm/4 plain --forms $F \
  --profile 30 > "$OUT/steps_s34c.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_s34c.txt" | cut -c1-150 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
