#!/bin/bash
# Issue 29 item 3 (composition cost), one H100/H200 call (<= 5 min): the chain kernel
# (kernels_pallas/gated_delta/chain_triton.py, chain_compose.compose_kernel: one pass per chain, maps read
# from the pool by slot, closed-form conv windows) against the per-position XLA loop it replaces on a GPU.
# (0) benchmarks/compose_forms.py: both forms x every precision on random Qwen3.5-0.8B-shaped maps, no model
# (the same 30 maps on 3 rows; a form that fails to compile prints its error), and the kernel's block_v x
# num_warps; (1) the kernel and composition tests compiled (tests/test_chain_compose_kernel.py;
# test_span_maps.py's per-precision exactness, through the loop while chain_compose.AUTO_KERNEL is off: rel. errors vs the fp32 replay
# printed), (2) rag fcfs on
# qwen3_5_0_8b with --compose-cost 1 (benchmarks/span_compose_cost.py): the warm step, its composition,
# "compose form triton | xla" timed in the same process on the same captured chains, and every precision
# (rel. diff. on probe maps: the random preset's captured A are 0). Results: $OUT/compose.txt.
# Prediction (Qwen3.5-0.8B, 30 maps on 3 rows, highest): the kernel reads A and B once per application
# (37.7 MB, ~13 us at 2.9 TB/s) and does 1.208 GFLOP of IEEE fp32 FMA (~25-35 TFLOP/s in Triton: 35-50 us),
# so ~1.0-1.5 ms FLOP-bound at highest (the loop: 2.9 ms), ~0.4-0.5 ms (memory-bound) at tf32_x3.
# CPU check: JAX_PLATFORMS=cpu MODEL=tiny_qwen3_5 DTYPE=float32 RAG_LIMIT=900 OUT=/tmp/x bash <this>
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
R=$OUT/compose.txt; T0=$SECONDS
git log --oneline -1 > $R 2>/dev/null
[ "$JAX_PLATFORMS" = cpu ] || timeout 75 python3 -m benchmarks.compose_forms 2>&1 | grep -E "compose form|compose kernel|rror" \
  | cut -c1-300 >> $R
echo "forms t=$((SECONDS-T0)) s" >> $R
MINIPIC_COMPILED=1 timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/test_chain_compose_kernel.py \
  tests/test_span_maps.py tests/test_gated_delta_affine.py::test_composed_span_maps_equal_replay \
  -k "precision or replay or kernel or window or presets" 2>&1 \
  | grep -E "compose precision|rel vs fp32|passed|failed|Error|assert" | cut -c1-200 >> $R
echo "tests rc=${PIPESTATUS[0]} t=$((SECONDS-T0)) s" >> $R
timeout ${RAG_LIMIT:-165} python3 -m benchmarks.cli rag --model ${MODEL:-qwen3_5_0_8b} --dtype ${DTYPE:-bfloat16} \
  --num-requests 24 --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 \
  --max-num-seqs 4 --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf \
  --modes offline --max-tokens 8 --compose-cost 1 --configs fcfs --out /tmp/rag_compose 2>&1 \
  | grep -E "^\[fcfs\] compose|rror" | cut -c1-400 >> $R
echo "rag rc=${PIPESTATUS[0]} t=$((SECONDS-T0)) s" >> $R
cat $R
