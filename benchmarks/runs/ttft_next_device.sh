#!/bin/bash
# Issue 28, one H100/H200 call (<= 9 min command time, fresh compile cache): the cached-span TTFT
# through LLM.generate with today's host path and resident block tables.
#   1. the host: python3 -VV, lscpu (how fast Python runs there), and `ttft-host` on its CPU (~10 s);
#   2. `rag --configs ttft --ttft-profile 1` (XLA's default command buffers; ~3 min: warm-up ~99 s):
#      cold / cached generate ms, host ms, step call, the cached step replayed alone, kernel busy.
#   CMDBUF=1 adds session 17's command-buffer A/B (measured then: no gain; "off", "on", FUSION..CUDNN
#   compiled again in the same process, then whole runs with step_command_buffer=on, ~5 min more).
# Prints one table; raw JSON in $OUT/ttft_xla/rag_bench.json.
# CPU check: JAX_PLATFORMS=cpu MODEL=tiny_llama3 DTYPE=float32 \
#   RAG_EXTRA="--ttft-spans 3 --ttft-span-tokens 40 --max-num-batched-tokens 256 --min-token-bucket 256" \
#   OUT=/tmp/x bash benchmarks/runs/ttft_next_device.sh
set -u
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jcc_ttft} PYTHONPATH=$PWD
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/ttft_next.txt; T0=$SECONDS
{ git log --oneline -1 2>/dev/null; python3 -VV; lscpu | head -20; } > "$R" 2>&1
JAX_PLATFORMS=cpu timeout 60 python3 -m benchmarks.cli ttft-host --repeats 5 --fresh-lists \
  --max-num-seqs 64 --min-token-bucket 128 >> "$R" 2>&1
echo "ttft-host rc=$? t=$((SECONDS-T0)) s" >> "$R"
RAG="python3 -m benchmarks.cli rag --configs ttft --ttft-profile 1 --in-process \
  --model ${MODEL:-tulu3_block_ft} --dtype ${DTYPE:-bfloat16} ${RAG_EXTRA:-}"
CB=""; [ "${CMDBUF:-0}" = 1 ] && CB="--ttft-command-buffers off on FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
timeout ${LIMIT_XLA:-270} $RAG --step-command-buffer xla --out "$OUT/ttft_xla" $CB > "$OUT/ttft_xla.txt" 2>&1
echo "rag xla rc=$? t=$((SECONDS-T0)) s" >> "$R"
RUNS="'xla': '$OUT/ttft_xla/rag_bench.json'"
if [ "${CMDBUF:-0}" = 1 ]; then
timeout ${LIMIT_ON:-190} $RAG --step-command-buffer on --out "$OUT/ttft_on" > "$OUT/ttft_on.txt" 2>&1
echo "rag on rc=$? t=$((SECONDS-T0)) s" >> "$R"
RUNS="$RUNS, 'on': '$OUT/ttft_on/rag_bench.json'"
LEFT=$((520 - SECONDS + T0))  # a second start of "on" if time is left: its steps load from the
if [ $LEFT -gt 60 ]; then     # executable store (do they keep their command buffers? `graphs`)
  timeout $LEFT $RAG --step-command-buffer on --out "$OUT/ttft_on2" > "$OUT/ttft_on2.txt" 2>&1
  echo "rag on (second start) rc=$? t=$((SECONDS-T0)) s" >> "$R"
  RUNS="$RUNS, 'on 2nd': '$OUT/ttft_on2/rag_bench.json'"
fi
fi
grep -h "^\[ttft\]" "$OUT"/ttft_*.txt | cut -c1-220 >> "$R"
python3 -c "from benchmarks.step_variants import ttft_summary
print('\n'.join(ttft_summary({$RUNS})))" >> "$R" 2>&1
cat "$R"
