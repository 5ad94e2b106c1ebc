#!/bin/bash
# The next session's first call (one `run`, <= 9.5 min, any card; written in session 41).
# On an H200: issue 28's first run (issue28_h200.sh 1). Elsewhere, issue 29's reordered span
# request, which session 41 found device-bound (H100: of call e's 22.5 ms, 18.8 busy; a decode
# step 383 kernels at 1.45 ms against a ~0.45 ms weight-read floor; the prefill + compose step
# 1,128 kernels, 6.0 ms, for 121 tokens): many small kernels in a row.
#   1. the 0.8B decode token (benchmarks.decode_token_ms, the span engine's options) under XLA's
#      command-buffer scheduling: the default, CONCURRENT (graph nodes ordered by their buffers,
#      so independent kernels may overlap) and the concurrent-region flag, one process each;
#   2. the span request (no warm-up, 8,192 blocks) with its reordered prefill step and a decode
#      step replayed alone with their 25 costliest kernels (`--profile-top 25`), default flags;
#   3. time left: the span request again under the fastest setting of 1 when it is not the
#      default (its e / d against 2's).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s42_device.sh
# (CPU smoke: MODEL=tiny_qwen3_5 OPTS='{"max_model_len": 1024, "num_kv_blocks": 256}' JAX_PLATFORMS=cpu)
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s42.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
if nvidia-smi -L 2>/dev/null | grep -q H200; then
  OUT=$OUT bash benchmarks/runs/issue28_h200.sh 1; exit
fi
nvidia-smi -L > "$R" 2>/dev/null
SPAN_ENGINE='{"max_model_len": 25600, "max_num_seqs": 64, "max_num_batched_tokens": 1024,
  "num_kv_blocks": 8192}'
OPTS=${OPTS:-$SPAN_ENGINE}
declare -A FLAGS=([default]="" [concurrent]="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
                  [region]="--xla_gpu_graph_enable_concurrent_region=true")
best=default; best_ms=
for name in default concurrent region; do
  line=$(XLA_FLAGS="${FLAGS[$name]}" timeout 120 python3 -m benchmarks.decode_token_ms \
    --model "${MODEL:-qwen3_5_0_8b}" --options "$OPTS" --name "$name" 2>&1 \
    | grep -E "ms a decode token|Error" | tail -1)
  echo "$line" | cut -c1-200 >> "$R"
  ms=$(echo "$line" | grep -oE "^[a-z]+: [0-9.]+" | awk '{print $2}')
  if [ -n "$ms" ] && { [ -z "$best_ms" ] || awk "BEGIN{exit !($ms < $best_ms * 0.97)}"; }; then
    best=$name; best_ms=$ms
  fi
done
echo "fastest (3% margin over the default): $best" >> "$R"
spans() {  # $1: label, $2: XLA flags, $3...: extra hybrid-spans flags
  local label=$1 flags=$2; shift 2; local t=$SECONDS
  XLA_FLAGS="$flags" timeout $(($(left) - 10)) python3 -m benchmarks.cli hybrid-spans \
    --model "${MODEL:-qwen3_5_0_8b}" --no-warmup --num-kv-blocks 8192 \
    --json "$OUT/hybrid_spans_$label.json" "$@" \
    > "$OUT/hybrid_spans_$label.txt" 2>&1
  echo "hybrid-spans ($label: $flags $*) rc=$? ($((SECONDS - t)) s)" >> "$R"
  grep -E "^(call|[d-f] )|goal .*/|^    (prefill|decode)" "$OUT/hybrid_spans_$label.txt" \
    | grep -v "^W1" | cut -c1-170 >> "$R"
}
spans default "" --profile-top 25
grep -A28 -E "profile-top" "$OUT/hybrid_spans_default.txt" | grep -v "^W1" | cut -c1-170 \
  | head -64 >> "$R"
if [ "$best" != default ] && [ "$(left)" -gt 170 ]; then spans "$best" "${FLAGS[$best]}"; fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
