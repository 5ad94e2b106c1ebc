#!/bin/bash
# Issue 28, one H200 call (<= 9 min command time, fresh compile cache): are the cached step's ~650
# kernel launches (its call returned after 3.3-3.5 ms) closed by XLA command buffers per step
# executable (Config.compilation.command_buffer, flat step_command_buffer)?
#   1. the host: python3 -VV, lscpu (how fast Python runs there), and `ttft-host` on its CPU (~10 s);
#   2. `rag --configs ttft --ttft-profile 1` with step_command_buffer=xla (today's default: XLA's own
#      command buffers) and, in the same process, the cached step compiled again with "off", "on"
#      (and FUSION..CUDNN plus DYNAMIC_SLICE_FUSION) and replayed (benchmarks/step_variants.py;
#      ~4 min: warm-up 99 s + 3 compiles);
#   3. the same run with step_command_buffer=on for every step (~2.5 min): TTFT through LLM.generate;
#   4. if time is left, a second start of 3 (steps loaded from the executable store, ~1 min).
# Prints one table (cold / cached generate ms, host ms, step_call, replayed call return, alone,
# kernel busy, kernels) and the in-process A/B; raw JSON in $OUT/ttft_{xla,on}/rag_bench.json.
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
timeout ${LIMIT_XLA:-270} $RAG --step-command-buffer xla --out "$OUT/ttft_xla" \
  --ttft-command-buffers off on FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION \
  > "$OUT/ttft_xla.txt" 2>&1
echo "rag xla rc=$? t=$((SECONDS-T0)) s" >> "$R"
timeout ${LIMIT_ON:-190} $RAG --step-command-buffer on --out "$OUT/ttft_on" > "$OUT/ttft_on.txt" 2>&1
echo "rag on rc=$? t=$((SECONDS-T0)) s" >> "$R"
RUNS="'xla': '$OUT/ttft_xla/rag_bench.json', 'on': '$OUT/ttft_on/rag_bench.json'"
LEFT=$((520 - SECONDS + T0))  # a second start of "on" if time is left: its steps load from the
if [ $LEFT -gt 60 ]; then     # executable store (do they keep their command buffers? `graphs`)
  timeout $LEFT $RAG --step-command-buffer on --out "$OUT/ttft_on2" > "$OUT/ttft_on2.txt" 2>&1
  echo "rag on (second start) rc=$? t=$((SECONDS-T0)) s" >> "$R"
  RUNS="$RUNS, 'on 2nd': '$OUT/ttft_on2/rag_bench.json'"
fi
grep -h "^\[ttft\]" "$OUT"/ttft_*.txt | cut -c1-220 >> "$R"
python3 -c "from benchmarks.step_variants import ttft_summary
print('\n'.join(ttft_summary({$RUNS})))" >> "$R" 2>&1
cat "$R"
