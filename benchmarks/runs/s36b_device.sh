#!/bin/bash
# Session 36's second device call (one `run`, <= 9.5 min, a short table last):
# 1. issue 29's span request (`hybrid-spans --steps`): cold vs plain <= 1.3x, reordered vs cold
#    (goal 0.2x), 0 compiles; s36_device.sh gave it 200 s, too few for the 39-variant warm-up
#    (167 s on an H100) and the calls: 330 s here;
# 2. the 32K GDN layer against fla with the scan's options swept on this card (`gdn --sweep`,
#    issue 29's goal <= 0.8x fla). Carry `.whl` (fla-core, flash-linear-attention, einops).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s36b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s36b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=330 bash benchmarks/runs/span_request_device.sh >> "$R"
if ls .whl/fla_core*.whl > /dev/null 2>&1; then
  timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
    .whl/fla_core*.whl .whl/flash_linear_attention*.whl .whl/einops*.whl > /dev/null 2>&1
fi
L=$(left)
[ "$L" -ge 90 ] && PYTHONPATH=$PWD:/tmp/site timeout $L python3 -m benchmarks.cli gdn \
  --tokens 32768 --reps 5 --variants fused_mosaic_out --sweep --sweep-budget-s $((L - 80)) \
  > "$OUT/gdn_sweep.txt" 2>&1
echo "gdn sweep rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^sweep scan" "$OUT/gdn_sweep.txt" | sort -t: -k2 -n | head -6 | cut -c1-120 >> "$R"
grep -E "^sweep (intra|output)" "$OUT/gdn_sweep.txt" | cut -c1-120 >> "$R"
grep -E "^sweep best|^ +32768 " "$OUT/gdn_sweep.txt" | cut -c1-120 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
