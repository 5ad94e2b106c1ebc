#!/bin/bash
# Why a decode step of the reordered span request takes ~2.2 ms in `hybrid-spans` (dispatch ~1 ms,
# read-back wait ~0.4 ms) when the same 0.8B decode step is 1.56 ms a token through
# LLM.generate in s40c_device.sh (session 41, H100). The engines differ in options: s40c's has
# max_model_len 1,024 and 256 KV blocks (XLA_PYTHON_CLIENT_PREALLOCATE=false), hybrid-spans' has
# max_model_len 25,600, 64 seats, 1,024 tokens a step and the default pool (all free memory,
# PREALLOCATE=true; XLA warns it cannot fit its step under the limit the pool leaves).
# Per setting, one process: ms a decode step = (t34 - t2) / 32 (median of 5, after an untimed
# pair) and the mean host ms of the step's dispatch (the compiled call) a decode step.
# The measurement is benchmarks/decode_token_ms.py (the same one, inline when this ran).
# usage: OUT=$OUT bash benchmarks/runs/s41b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s41b.txt
nvidia-smi -L > "$R" 2>/dev/null
BIG='"max_model_len": 25600, "max_num_seqs": 64, "max_num_batched_tokens": 1024'
while IFS='|' read -r name prealloc opts; do
  [ -z "$name" ] && continue
  XLA_PYTHON_CLIENT_PREALLOCATE=$prealloc timeout 150 python3 -m benchmarks.decode_token_ms \
    --model "${MODEL:-qwen3_5_0_8b}" --options "{$opts}" --name "$name" >> "$R" 2>&1
  echo "  rc=$? t=$((SECONDS-T0)) s" >> "$R"
done <<CONFIGS
s40c|false|"max_model_len": 1024, "num_kv_blocks": 256
spans_engine|true|$BIG
spans_engine_noprealloc|false|$BIG
spans_engine_4096_blocks|true|$BIG, "num_kv_blocks": 4096
CONFIGS
# the span request on an engine of 8,192 KV blocks (1.5 GiB at 0.8B), nothing preallocated
t=$SECONDS
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $((${TOTAL:-560} - SECONDS + T0 - 10)) python3 -m \
  benchmarks.cli hybrid-spans --no-warmup --num-kv-blocks ${SPAN_BLOCKS:-8192} \
  --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans --no-warmup --num-kv-blocks ${SPAN_BLOCKS:-8192} rc=$? ($((SECONDS - t)) s)" >> "$R"
grep -E "^(call|[a-g] )|goal .*/|^    (prefill|decode)|^    kind" "$OUT/hybrid_spans.txt" \
  | grep -v "^W1" | sed -n 1,40p | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
