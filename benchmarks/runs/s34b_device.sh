#!/bin/bash
# Session 34's second device call (one `run`, <= 9.5 min, a short table last): what sessions
# 31-33 owed and s33b_device.sh did not hold.
# 1. the compiled engine tests owed since session 31 (s31d_device.sh: GDN_FINALS_IN_PLACE, on
#    since session 31, and DECODE_GATES_IN_PROJ through LLM.generate; the in-place decode
#    engine steps; the tiny engine's default pool on the GPU);
# 2. issue 29's span request (0 compiles, cold / plain, reordered / cold) with its reordered
#    prefill and decode steps replayed and profiled today and with DECODE_GATES_IN_PROJ=1 (the
#    decode step's a / b / z read in the projection: 3 slice kernels a GDN layer fewer);
# 3. the 32K GDN layer against fla with the scan's options swept on this card (carry `.whl`:
#    fla-core, flash-linear-attention 0.5.2 and einops wheels for the fla rows).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s34b_device.sh   (carry [".whl"])
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s34
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s34b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
OUT=$OUT bash benchmarks/runs/s31d_device.sh > /dev/null 2>&1
cat "$OUT/s31d.txt" > "$R"
L=$(left); [ "$L" -gt 230 ] && L=230
OUT=$OUT LIMIT=$L EXTRA="--profile-top 12 --profile-forms DECODE_GATES_IN_PROJ=1" \
  bash benchmarks/runs/span_request_device.sh >> "$R"
if ls .whl/fla_core*.whl > /dev/null 2>&1; then
  timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
    .whl/fla_core*.whl .whl/flash_linear_attention*.whl .whl/einops*.whl > /dev/null 2>&1
fi
L=$(left)
[ "$L" -ge 90 ] && PYTHONPATH=$PWD:/tmp/site timeout $L python3 -m benchmarks.cli gdn \
  --tokens 32768 --reps 5 --variants fused_mosaic_out --sweep --sweep-budget-s $((L - 60)) \
  --profile > "$OUT/gdn_sweep.txt" 2>&1
echo "gdn sweep rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^sweep scan" "$OUT/gdn_sweep.txt" | sort -t: -k2 -n | head -6 | cut -c1-120 >> "$R"
grep -E "^sweep best|^ +32768 " "$OUT/gdn_sweep.txt" | cut -c1-120 >> "$R"
grep -E "profile: busy" "$OUT/gdn_sweep.txt" | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
