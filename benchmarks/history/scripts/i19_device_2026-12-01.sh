#!/bin/bash
# issue 19 device call: compiled GDN tests (background), rag on qwen3_5_0_8b, gdn bench
cd "$(dirname "$0")"
export PYTHONPATH=$PWD:/tmp/site JAX_COMPILATION_CACHE_DIR=/tmp/jcc MINIPIC_COMPILATION_CACHE_DIR=/tmp/jcc PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS
cp COMMIT $OUT/commit.txt
(python3 -m pip install --no-deps --no-index --target /tmp/site whl/*.whl > $OUT/pip.txt 2>&1) &
(MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 130 python3 -m pytest -v -rfE -p no:cacheprovider -o addopts= tests/test_gated_delta.py tests/test_gated_delta_affine.py tests/test_gated_delta_blocked.py tests/test_span_maps.py -n 4 > $OUT/tests.txt 2>&1; echo "rc=$? t=$((SECONDS-T0))" >> $OUT/tests.txt) &
TP=$!
timeout 135 python3 -m benchmarks.cli rag --model qwen3_5_0_8b --num-requests 24 --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 --max-num-seqs 4 --max-model-len 4096 --num-kv-blocks 4096 --configs pic_off fcfs --workloads multi zipf --modes offline --max-tokens 8 --compose-cost 1 --out $OUT > $OUT/rag.txt 2>&1
echo "rag rc=$? t=$((SECONDS-T0))" >> $OUT/rag.txt
wait $TP
LEFT=$((212 - SECONDS + T0))
echo "gdn budget $LEFT s"
if [ $LEFT -gt 25 ]; then
  timeout $LEFT python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 --checkpoints 16 --variants fused blocked16 blocked32 blocked8 blocked16_xla --json $OUT/gdn.json > $OUT/gdn.txt 2>&1
  echo "gdn rc=$? t=$((SECONDS-T0))" >> $OUT/gdn.txt
fi
echo "== tests"; grep -E "PASS|FAIL|ERROR|passed|failed|rc=" $OUT/tests.txt | tail -45
echo "== rag"; grep -E "^\[|rc=|Error|error" $OUT/rag.txt | tail -14
echo "== gdn"; tail -16 $OUT/gdn.txt 2>/dev/null
