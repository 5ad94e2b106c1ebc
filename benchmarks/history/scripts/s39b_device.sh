#!/bin/bash
# Ran at 6e181d2 (s39c_gdn_device.sh is in this folder now; check that commit out to rerun).
# Session 39's second call (one `run`, <= 9.5 min, any card): first the gated delta rule's
# output computed in the state scan against fla at 32K (s39c_gdn_device.sh, wheels in $WHL;
# issue 29's GDN goal), then rag at 16 seats once (issue 29's goal, spans >= 1.0x prefix
# caching on multi and zipf with the span capture policy: a second run beside session 38's).
# usage: OUT=$OUT [TOTAL=seconds] [WHL=folder] bash benchmarks/runs/s39b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s39b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
W=${WHL:-.whl}; ls "$W"/fla_core*.whl > /dev/null 2>&1 || W=whl39  # an untracked copy travels
OUT=$OUT TOTAL=330 TESTS_LIMIT=120 WHL=$W bash benchmarks/runs/s39c_gdn_device.sh \
  > /dev/null 2>&1
cat "$OUT/s39c.txt" > "$R"
L=$(left); [ "$L" -gt 110 ] && L=110
[ "$L" -ge 60 ] && OUT=$OUT LIMIT=$L NAME=rag COMPOSE=0 CONFIGS="pic_off fcfs" \
  bash benchmarks/runs/rag16_device.sh | grep " rc=" >> "$R"
grep -E "hit rate|span maps" "$OUT/rag.txt" 2>/dev/null \
  | sed -E "s/, [0-9.]+ total tokens.*hit rate/, hit rate/; s/TTFT.*//" | cut -c1-150 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
