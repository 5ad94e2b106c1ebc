#!/bin/bash
# Issue 29 item 3 (composition cost), one H200 call (<= 5 min): after chain_compose.py (the composition
# runs only the map applications its chains hold) and span_map_compose_precision. (1) the composition
# exactness tests compiled, one per precision (tests/test_span_maps.py -k precision: rel. errors vs the
# fp32 replay printed) and the default's (test_gated_delta_affine), (2) rag fcfs on qwen3_5_0_8b with
# run 3's flags and --compose-cost 1 (benchmarks/span_compose_cost.py): the warm step, its composition,
# the plan's applications/GFLOP, and the captured chains under every precision. Results: $OUT/compose.txt.
# CPU check: JAX_PLATFORMS=cpu MODEL=tiny_qwen3_5 DTYPE=float32 RAG_LIMIT=900 OUT=/tmp/x bash <this>
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
R=$OUT/compose.txt; T0=$SECONDS
git log --oneline -1 > $R 2>/dev/null
MINIPIC_COMPILED=1 timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/test_span_maps.py \
  tests/test_gated_delta_affine.py::test_composed_span_maps_equal_replay -k "precision or replay" 2>&1 \
  | grep -E "compose precision|rel vs fp32|passed|failed|Error" | cut -c1-200 >> $R
echo "tests rc=${PIPESTATUS[0]} t=$((SECONDS-T0)) s" >> $R
timeout ${RAG_LIMIT:-210} python3 -m benchmarks.cli rag --model ${MODEL:-qwen3_5_0_8b} --dtype ${DTYPE:-bfloat16} \
  --num-requests 24 --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 \
  --max-num-seqs 4 --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf \
  --modes offline --max-tokens 8 --compose-cost 1 --configs fcfs --out /tmp/rag_compose 2>&1 \
  | grep -E "^\[fcfs\] compose|rror" | cut -c1-400 >> $R
echo "rag rc=${PIPESTATUS[0]} t=$((SECONDS-T0)) s" >> $R
cat $R
