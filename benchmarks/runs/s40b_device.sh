#!/bin/bash
# Session 40's second call (one `run`, <= 7 min, any card): is the reordered span request's decode
# host-bound on launches? s40a's device trace of call c: a decode step is 383 kernels, 1.45 ms
# busy, with ~2 ms of device idle around it; the host's dispatch alone 0.92 ms a step (XLA's
# default command buffers stop at every custom call, so the Pallas kernels of 24 layers split the
# step into launches). The same request with step_command_buffer=on (custom calls in the graphs,
# any graph size) against the default, each in its own process on this host, without the
# warm-up (the variants compile at first use; calls c and e are timed after theirs compiled).
# usage: OUT=$OUT [TOTAL=seconds] [CBS="on xla"] bash benchmarks/runs/s40b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=true PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s40b.txt
nvidia-smi -L > "$R" 2>/dev/null
CBS=${CBS:-on xla}; set -- $CBS
half=$(( (${TOTAL:-400} - 10) / $# ))
for cb in $CBS; do
  t=$SECONDS
  timeout $half python3 -m benchmarks.cli hybrid-spans --no-warmup --steps --device-trace \
    --step-command-buffer $cb --json "$OUT/hs_$cb.json" > "$OUT/hs_$cb.txt" 2>&1
  echo "== step_command_buffer=$cb rc=$? ($((SECONDS-t)) s)" >> "$R"
  grep -E "^(call|[a-g] )|goal .*/|^    (prefill|decode)|^    kind|device timeline" \
    "$OUT/hs_$cb.txt" | grep -v "^W1" | cut -c1-150 >> "$R"
  grep -E "  burst" "$OUT/hs_$cb.txt" | sed -n 3,8p >> "$R"
  grep -E "Error|error:" "$OUT/hs_$cb.txt" | head -5 >> "$R"
done
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
