#!/bin/bash
# The third device call of session 32 (<= 9.5 min, a short table last): where a warm span step's
# premium over a plain one goes (rag's 1,024-token steps at 16 seats, the 40 costliest kernels of
# each; s31: 12.16 vs 7.96 ms, 797 vs 612 kernels), then the 32K GDN layer against fla with the
# scan's options swept on this card (`gdn --sweep`: DEFAULTS came from an H200 sweep; the scan
# is 0.455 ms of the 1.14 ms `fused_mosaic_out` layer on an H100, s26b). Carry `.whl` (fla-core
# and einops wheels) for the fla rows.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s32c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s32
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s32c.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
timeout 150 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
  --variants plain warm/0 --forms new --profile 40 > "$OUT/steps_top40.txt" 2>&1
echo "span_step_work rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|kernels, busy" "$OUT/steps_top40.txt" | cut -c1-150 >> "$R"
if ls .whl/fla_core*.whl > /dev/null 2>&1; then
  timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
    .whl/fla_core*.whl .whl/einops*.whl > /dev/null 2>&1
fi
L=$(left)
[ "$L" -ge 90 ] && PYTHONPATH=$PWD:/tmp/site timeout $L python3 -m benchmarks.cli gdn \
  --tokens 32768 --reps 5 --variants fused_mosaic_out --sweep --sweep-budget-s 150 \
  --profile > "$OUT/gdn_sweep.txt" 2>&1
echo "gdn sweep rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^sweep scan" "$OUT/gdn_sweep.txt" | sort -t: -k2 -n | head -6 | cut -c1-120 >> "$R"
grep -E "^sweep best|^ +32768 " "$OUT/gdn_sweep.txt" | cut -c1-120 >> "$R"
grep -E "profile: busy" "$OUT/gdn_sweep.txt" | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
