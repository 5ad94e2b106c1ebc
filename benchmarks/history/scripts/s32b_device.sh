#!/bin/bash
# The second device call of session 32 (<= 9.5 min, a short table last):
# 1. issue 29's span request with the GDN finals in place (on since session 31: its cold and
#    plain calls' prefill steps are plain steps), its reordered prefill and decode profiled
#    again with the checkpoint rows stored layer by layer (CHECKPOINTS_STACKED=0, session 32);
# 2. where a warm span step's premium over a plain one goes (rag's 1,024-token steps at 16
#    seats, the 40 costliest kernels of each; s31: 12.16 vs 7.96 ms, 797 vs 612 kernels);
# 3. the 32K GDN layer against fla with the scan's options swept on this card (`gdn --sweep`:
#    fused_triton.DEFAULTS came from an H200 sweep; the scan is 0.455 of the 1.14 ms
#    `fused_mosaic_out` layer on an H100, s26b). Carry `.whl` (fla-core and einops wheels:
#    `mkdir .whl; cp /opt/pypi/files/{fla_core,flash_linear_attention}-0.5.2*.whl
#    /opt/pypi/files/einops-0.8.2*.whl .whl/`) for the fla rows.
# Session 33 put first: the captures' map products by a scan over their local chunks
# (qwen3_5_joint.TRANSITIONS_IN_STREAM=0) and a span step's finals written in place by the scan
# (qwen3_5_joint.FINALS_IN_PLACE=1), both off until this: their compiled bit-for-bit tests,
# then (2) times warm/4 / warm/0 today, with both (span_both) and with the scan alone
# (trans_scan); the span request runs without its CHECKPOINTS_STACKED profile (s32_device.sh's
# fixed-step A/B decides the store).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s32b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s32
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s32b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_transition_scan.py tests/test_span_finals_in_place.py > "$OUT/tests_trans.txt" 2>&1
echo "compiled transition-scan + span finals tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_trans.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_trans.txt" | cut -c1-200 | sort -u | head -6 >> "$R"
OUT=$OUT LIMIT=200 EXTRA="--profile-top 12" bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); [ "$L" -gt 160 ] && L=160
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b \
  --dtype bfloat16 --reps 9 --variants warm/4 warm/0 --forms new span_both trans_scan \
  --profile 40 > "$OUT/steps_top40.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_top40.txt" | cut -c1-150 >> "$R"
if ls .whl/fla_core*.whl > /dev/null 2>&1; then
  timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
    .whl/fla_core*.whl .whl/einops*.whl > /dev/null 2>&1
fi
L=$(left)
[ "$L" -ge 90 ] && PYTHONPATH=$PWD:/tmp/site timeout $L python3 -m benchmarks.cli gdn \
  --tokens 32768 --reps 5 --variants fused_mosaic_out --sweep --sweep-budget-s 100 \
  --profile > "$OUT/gdn_sweep.txt" 2>&1
echo "gdn sweep rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^sweep scan" "$OUT/gdn_sweep.txt" | sort -t: -k2 -n | head -6 | cut -c1-120 >> "$R"
grep -E "^sweep best|^ +32768 " "$OUT/gdn_sweep.txt" | cut -c1-120 >> "$R"
grep -E "profile: busy" "$OUT/gdn_sweep.txt" | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
