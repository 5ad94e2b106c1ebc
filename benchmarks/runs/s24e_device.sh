#!/bin/bash
# Session 24's last call (<= 3.5 min, the budget's end): after a chunk that only enters with cached
# maps runs the plain variant. Issue 29's span request without warm-up (--no-warmup: the second
# set, d / e, runs compiled; the goal lines e/d and d/f hold) with 1,024-token long spans (call g
# shorter), then rag at 16 seats (pic_off vs fcfs, compose program profiled).
# usage: OUT=$OUT bash benchmarks/runs/s24e_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s24
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s24e.txt
nvidia-smi -L > "$R" 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 100 python3 -m benchmarks.cli hybrid-spans --steps \
  --no-warmup --long-span-tokens 1024 --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^(call|[a-g] )|goal|^    (prefill|decode)" "$OUT/hybrid_spans.txt" | cut -c1-200 >> "$R"
timeout 75 python3 -m benchmarks.cli rag --model qwen3_5_0_8b --dtype bfloat16 --num-requests 24 \
  --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 --max-num-seqs 16 \
  --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf --modes offline --max-tokens 8 \
  --configs pic_off fcfs --compose-cost 1 --out "$OUT/rag" > "$OUT/rag.txt" 2>&1
echo "rag rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "requests/s|compose (cost|program) " "$OUT/rag.txt" | cut -c1-300 >> "$R"
rm -f "$OUT/rag/rag_bench.png"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
