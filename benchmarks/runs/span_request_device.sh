#!/bin/bash
# Issue 29's span request as the session 24-26 device calls run it (`minipic-bench hybrid-spans
# --steps --sync-repeat`, memory preallocated), after PRE (python statements, e.g. a module
# switch: PRE=$'from minipic_jax.models import qwen3_5\nqwen3_5.GDN_DECODE_IN_PLACE = True').
# Writes $OUT/hybrid_spans.txt and .json; prints its rc and table rows (append them to a table).
# usage: OUT=$OUT LIMIT=seconds [PRE=...] bash benchmarks/runs/span_request_device.sh >> table.txt
set -u; T0=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout ${LIMIT:-170} python3 -c "
import sys
${PRE:-}
from benchmarks.cli import main
sys.exit(main(['hybrid-spans', '--steps', '--sync-repeat', '--json', '$OUT/hybrid_spans.json']))
" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? ($((SECONDS-T0)) s)"
grep -E "^(call|[a-i] )|goal|warm-up|^    (prefill|decode)" "$OUT/hybrid_spans.txt" | grep -v "^W1" \
  | cut -c1-200
