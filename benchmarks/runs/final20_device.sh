#!/bin/bash
# Session 20's last device call (<= 9.5 min, carry .whl): after "auto" started composing span chains
# with the Triton chain kernel at the default tf32_x3 on a GPU:
#   1. compiled tests of the composition path (the kernel, every precision's exactness bar through
#      entry_states, the engine composing by the kernel against the float64 reference) (~1 min);
#   2. rag at 16 seats, fcfs, --compose-cost 1: the composition's share of its warm step in the
#      engine (goal <= 5%), multi / zipf requests/s (pic_off: runs/rag_qwen3_5_16seats_*_s20.json) (~1.5 min);
#   3. GDN prefill at 32K, fla vs the fused variants incl. the lean Mosaic one (goal <= 0.8x fla) (~2 min);
#   4. the chain kernel's num_stages at the tensor-core precisions (~1 min);
#   5. if time is left: `minipic-bench hybrid-spans --steps --sync-repeat` with
#      CUDA_MODULE_LOADING=EAGER (the reordered request, goal <= 0.2x cold; session 20's first run
#      showed every first call of its kind ~20-27 ms slower, a - f, b - d, c - e: lazy loading?).
# usage: OUT=$OUT bash benchmarks/runs/final20_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_final
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/final20.txt
{ git log --oneline -1; nvidia-smi -L; } > $R 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -s \
  tests/test_chain_compose_kernel.py tests/test_span_maps.py -k "precision or kernel or window or presets or replay" \
  > $OUT/compose_tests.txt 2>&1
echo "compose tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 $OUT/compose_tests.txt)" >> $R
grep -E "^(FAILED|ERROR) |compose precision" $OUT/compose_tests.txt | cut -c1-200 >> $R
timeout 150 python3 -m benchmarks.cli rag --model qwen3_5_0_8b --dtype bfloat16 --num-requests 24 \
  --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 --max-num-seqs 16 \
  --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf --modes offline --max-tokens 8 \
  --configs fcfs --compose-cost 1 --out $OUT/rag_fcfs > $OUT/rag_fcfs.txt 2>&1
echo "rag rc=$? t=$((SECONDS-T0)) s" >> $R
grep -E "requests/s|compose" $OUT/rag_fcfs.txt | cut -c1-260 >> $R
timeout 60 python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/fla_core*.whl .whl/einops*.whl \
  > /dev/null 2>&1
PYTHONPATH=$PWD:/tmp/site timeout 140 python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 \
  --variants fused fused_mosaic_out fused_mosaic_out_lean > $OUT/gdn.txt 2>&1
echo "gdn rc=$? t=$((SECONDS-T0)) s" >> $R; grep -E "32768|fla|rror" $OUT/gdn.txt | tail -12 | cut -c1-220 >> $R
timeout 75 python3 -m benchmarks.compose_forms stages 2>&1 | grep -E "compose stages|rror" | cut -c1-200 >> $R
echo "stages t=$((SECONDS-T0)) s" >> $R
L=$((555 - SECONDS + T0))
if [ $L -gt 150 ]; then
  CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER} timeout $((L - 5)) python3 -m benchmarks.cli hybrid-spans \
    --steps --sync-repeat --json $OUT/hybrid_spans.json \
    > $OUT/hybrid_spans.txt 2>&1
  echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> $R; grep -vE "^W1|compiling step" $OUT/hybrid_spans.txt | tail -60 | cut -c1-200 >> $R
fi
cat $R
