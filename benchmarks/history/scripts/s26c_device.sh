#!/bin/bash
# Session 26's third device call (one `run`, <= 9.5 min, a short table last; raw files under
# $OUT): the split-K ragged attention (triton_ragged.RAGGED_SPLITS) and the wider decode splits
# (triton_decode.WIDE_SPLITS). s26b's profile of the reordered prefill step: ragged_paged_
# attention 4.98 of 10.27 ms (8 programs over 91 key steps each). 1. compiled tests of both
# kernels; 2. issue 29's span request, its reordered prefill and decode steps replayed with the
# switches on and off (`--profile-forms`); 3. plain prefill / decode at 64 seats, on vs off (no
# regression where contexts are short); 4. rag at 16 seats.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s26c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s26
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s26c.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
  tests/test_paged_attention.py tests/test_paged_attention_decode.py \
  -k "Triton or triton or split or ragged" > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 230 python3 -m benchmarks.cli hybrid-spans --steps \
  --sync-repeat --profile-top 8 --profile-forms RAGGED_SPLITS=0,WIDE_SPLITS=0 \
  --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(call|[a-i] )|goal|warm-up|^    (prefill|decode)|^profile" "$OUT/hybrid_spans.txt" \
  | grep -v "^W1" | cut -c1-200 >> "$R"
L=$(left); [ "$L" -gt 110 ] && L=110
if [ "$L" -ge 60 ]; then
  timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
    --tokens 128 1024 --reps 10 --ckpt 1 --decode --profile 4 \
    --forms RAGGED_SPLITS=1,WIDE_SPLITS=1 RAGGED_SPLITS=0,WIDE_SPLITS=0 \
    > "$OUT/fixed_step.txt" 2>&1
  echo "fixed step rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "ms/step|kernels, busy|forms=|attention" "$OUT/fixed_step.txt" | cut -c1-200 >> "$R"
fi
L=$(left); [ "$L" -gt 120 ] && L=120
if [ "$L" -ge 75 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
