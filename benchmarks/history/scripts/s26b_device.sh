#!/bin/bash
# Session 26's second device call (one `run`, <= 9.5 min, a short table last; raw files under
# $OUT), with the in-place GDN decode on (its glue form, the default since s26): 1. issue 29's
# span request, then its reordered prefill step and a decode step at that context replayed alone
# and profiled (`--profile-top 30`: where the reordered call's ~10 ms prefill and ~2 ms decodes
# go); 2. rag at 16 seats (pic_off vs fcfs, multi / zipf); 3. if time is left, the GDN prefill
# at 32K by part (solve / scan / output / glue, `gdn --profile`, fla 0.6.0 carried in .whl).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s26b_device.sh   (carry .whl)
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s26
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s26b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 200 python3 -m benchmarks.cli hybrid-spans --steps \
  --sync-repeat --profile-top 30 --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(call|[a-i] )|goal|warm-up|^    (prefill|decode)|^profile" "$OUT/hybrid_spans.txt" \
  | grep -v "^W1" | cut -c1-200 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
if [ "$L" -ge 80 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
L=$(left)
if [ "$L" -ge 60 ]; then
  timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
    .whl/fla_core*.whl .whl/einops*.whl > /dev/null 2>&1
  PYTHONPATH=$PWD:/tmp/site timeout $L python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 \
    --variants fused_mosaic_out --profile > "$OUT/gdn.txt" 2>&1
  echo "gdn rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -v "^W1" "$OUT/gdn.txt" | tail -30 | cut -c1-200 >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
