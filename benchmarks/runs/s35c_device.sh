#!/bin/bash
# Session 35's third device call (one `run`, <= 9.5 min, a short table last; carry `.whl`:
# fla-core / flash-linear-attention 0.5.2 and einops wheels, for the fla rows):
# 1. issue 29's span request (6 x 900-token spans: cold vs plain, reordered vs cold, 0
#    compiles) with today's defaults (FLOW_BORROWS on if s35b's compiled tests passed);
# 2. rag fcfs at 16 seats with --compose-cost 1: the compose program's share of its step as the
#    engine runs it (the "pipelined" line: dropped on a GPU before session 35's fix);
# 3. the 32K GDN layer against fla, the scan's options swept on this card.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s35c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s35c.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT LIMIT=200 bash benchmarks/runs/span_request_device.sh >> "$R"
L=$(left); L=$((L - 170)); [ "$L" -gt 120 ] && L=120
[ "$L" -ge 70 ] && OUT=$OUT LIMIT=$L NAME=rag_compose CONFIGS=fcfs \
  bash benchmarks/runs/rag16_device.sh >> "$R"
grep -E "compose program pipelined" "$OUT/rag_compose.txt" | cut -c1-250 >> "$R"
if ls .whl/fla_core*.whl > /dev/null 2>&1; then
  timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
    .whl/fla_core*.whl .whl/flash_linear_attention*.whl .whl/einops*.whl > /dev/null 2>&1
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
