#!/bin/bash
# Session 38's last call (one `run`, <= 9.5 min): on an H200 issue 28's first run
# (issue28_h200.sh 1: the cached-span TTFT through LLM.generate, the exact XLA limit at
# 40,960); on any other card issue 29's span request (span_request_device.sh: 0 compiles, cold
# vs plain, reordered vs cold) with the span capture policy on by default (Config.span_maps.
# capture "auto": a fresh engine captures a lone request's spans, so the reordered call skips
# them).
# usage: OUT=$OUT bash benchmarks/runs/s38d_device.sh
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if nvidia-smi -L 2>/dev/null | grep -q H200; then
  OUT=$OUT bash benchmarks/runs/issue28_h200.sh 1
else
  nvidia-smi -L > "$OUT/s38d.txt" 2>/dev/null
  OUT=$OUT LIMIT=420 EXTRA="--admit-profile $OUT/admit_profile.txt" \
    bash benchmarks/runs/span_request_device.sh >> "$OUT/s38d.txt"
  # the engine's admission by function (own time) against the stub's on this host's CPU
  grep -E "function calls|tottime|\.py" "$OUT/admit_profile.txt" | head -14 | cut -c1-140 \
    >> "$OUT/s38d.txt"
  JAX_PLATFORMS=cpu PSTATS_SORT=tottime timeout 60 python3 -m benchmarks.span_admission_host \
    --profile > "$OUT/admit_stub.txt" 2>&1
  grep -E "admit [0-9]|function calls|tottime|\.py" "$OUT/admit_stub.txt" | head -14 \
    | cut -c1-140 >> "$OUT/s38d.txt"
  cat "$OUT/s38d.txt"
fi
