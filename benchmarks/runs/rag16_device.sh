#!/bin/bash
# Issue 29's rag run at 16 seats, as every session-23/24 device call ran it (one process:
# pic_off vs fcfs on multi and zipf, qwen3_5_0_8b bf16, 24 requests, 1,024-token steps,
# --compose-cost 1: the composition and, on a GPU, the engine's compose program profiled).
# Writes $OUT/$NAME.txt and $OUT/$NAME/ (NAME: rag); prints its rc and summary lines (append them
# to a table). CONFIGS (pic_off fcfs), COMPOSE (1: --compose-cost), FORM (a --program-form,
# none by default) and REPEATS (5 since session 39: each workload run 5 times on its engine, the
# median by requests/s reported; sessions 23-39 ran 1, whose zipf ratio spread 0.88-1.11x on
# one tree) change the run.
# usage: OUT=$OUT LIMIT=seconds [NAME=..] [CONFIGS=..] [COMPOSE=0|1] [FORM=..] [REPEATS=n]
#        bash benchmarks/runs/rag16_device.sh >> table.txt
set -u; T0=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout ${LIMIT:-150} python3 -m benchmarks.cli rag --model qwen3_5_0_8b --dtype bfloat16 \
  --num-requests 24 --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 \
  --max-num-seqs 16 --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf \
  --modes offline --max-tokens 8 --repeats ${REPEATS:-5} --configs ${CONFIGS:-pic_off fcfs} \
  --compose-cost ${COMPOSE:-1} \
  ${FORM:+--program-form $FORM} --out "$OUT/${NAME:-rag}" > "$OUT/${NAME:-rag}.txt" 2>&1
echo "${NAME:-rag} rc=$? ($((SECONDS-T0)) s)"
grep -E "requests/s|compose (cost|form triton|bf16_x6|program)" "$OUT/${NAME:-rag}.txt" | cut -c1-330
rm -f "$OUT/${NAME:-rag}/rag_bench.png"
