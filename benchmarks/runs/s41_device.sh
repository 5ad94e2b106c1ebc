#!/bin/bash
# The next session's first call (one `run`, <= 9.5 min, any card; written in session 40).
# On an H200: issue 28's first run (issue28_h200.sh 1). Elsewhere, issue 29's reordered span
# request, whose decodes are host-bound (session 40, H100: a decode step 383 kernels, 1.45 ms busy,
# ~2 ms of device idle before it, dispatch 0.92 ms a step):
#   1. the 0.8B decode step under step_command_buffer xla (the default) / off / on, and on and
#      xla with XLA's command-buffer update mode SKIP_PROFILED (graphs not updated for buffers
#      that keep their place), each in its own process on this host (s40c_device.sh: ms a
#      decode step, median of 5);
#   2. the span request without the warm-up (calls d-f timed after their variants compiled),
#      its reordered call's device timeline naming what the host did in each idle gap
#      (`--device-trace`: host_in_idle / python_in_idle).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s41_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s41.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
if nvidia-smi -L 2>/dev/null | grep -q H200; then
  OUT=$OUT bash benchmarks/runs/issue28_h200.sh 1; exit
fi
nvidia-smi -L > "$R" 2>/dev/null
OUT=$OUT CBS="xla off on on:SKIP_PROFILED xla:SKIP_PROFILED" timeout 300 \
  bash benchmarks/runs/s40c_device.sh > /dev/null 2>&1
grep -E "step_command_buffer|rc=|Error" "$OUT/s40c.txt" | cut -c1-200 | head -20 >> "$R"
L=$(left); t=$SECONDS
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout $((L - 10)) python3 -m benchmarks.cli hybrid-spans \
  --no-warmup --steps --device-trace --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans --no-warmup rc=$? ($((SECONDS - t)) s)" >> "$R"
grep -E "^(call|[a-g] )|goal .*/|^    (prefill|decode)|device timeline" "$OUT/hybrid_spans.txt" \
  | grep -v "^W1" | cut -c1-150 >> "$R"
grep -E "  burst|_in_idle" "$OUT/hybrid_spans.txt" | sed -n 1,24p | cut -c1-220 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
