#!/bin/bash
# Issue 29's span request on the device, as the session-27 device calls ran it (`hybrid-spans
# --steps`, the engine's default options, one process, the memory preallocated). Writes
# $OUT/hybrid_spans.txt / .json; prints its rc and the call, step, goal and profile lines
# (append them to a table).
# usage: OUT=$OUT [LIMIT=seconds] [EXTRA="--profile-top 12"] bash benchmarks/runs/span_request_device.sh >> t
set -u; T0=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout ${LIMIT:-260} python3 -m benchmarks.cli hybrid-spans \
  --steps ${EXTRA:-} --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? ($((SECONDS-T0)) s)"
grep -E "^(call|[a-i] )|goal|warm-up [0-9]|^    (prefill|decode)|kernels, busy" \
  "$OUT/hybrid_spans.txt" | grep -v "^W1" | cut -c1-150
