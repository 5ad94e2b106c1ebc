#!/bin/bash
# Issue 19 device call, session 9 (H200, <= 290 s): rag fcfs on qwen3_5_0_8b (per-variant compile
# times of the step from JAX_LOG_COMPILES), the GDN 32K prefill bench against fla (wheels carried
# in .whl/), then rag pic_off (same flags; session 8 has its figure) in the time left. Each part
# under its own limit; one results file: $OUT/i19.txt.
# CPU check: MODEL=tiny_qwen3_5 DTYPE=float32 LIMITS="900 0 600" OUT=/tmp/x bash <this>
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT/i19.txt; T0=$SECONDS; read -r LIM_FCFS LIM_GDN LIM_PIC <<< "${LIMITS:-120 100 290}"
git log --oneline -1 > $R 2>/dev/null
(python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl > /tmp/pip.txt 2>&1) &
RAG="--model ${MODEL:-qwen3_5_0_8b} --dtype ${DTYPE:-bfloat16} --num-requests 24
 --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 --max-num-seqs 4
 --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf --modes offline --max-tokens 8
 --compose-cost 1"
rag() {  # config, limit
  echo "== rag $1 (limit $2 s)" >> $R
  JAX_LOG_COMPILES=1 timeout $2 python3 -m benchmarks.cli rag $RAG --configs $1 --out /tmp/rag_$1 \
    2>&1 | grep -E "Finished .*_step_impl|^\[|^loaded|rror" | cut -c1-400 >> $R
  echo "rag $1 rc=${PIPESTATUS[0]} t=$((SECONDS-T0))" >> $R
  python3 -c "import json; d=json.load(open('/tmp/rag_$1/rag_bench.json'))
for x in d['results']:
  for r in x.get('runs', []): r.pop('outputs', None)
print(json.dumps(d['results']))" >> $R 2>/dev/null
}
rag fcfs $LIM_FCFS
wait
if [ "$LIM_GDN" -gt 0 ]; then
  echo "== gdn (limit $LIM_GDN s)" >> $R
  timeout $LIM_GDN python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 --checkpoints 16 \
    --variants fused blocked16 blocked8 blocked32 blocked4 blocked16_bv32 blocked16_xla >> $R 2>&1
  echo "gdn rc=$? t=$((SECONDS-T0))" >> $R
  tail -3 /tmp/pip.txt >> $R
fi
LEFT=$((LIM_PIC - SECONDS + T0))
[ $LEFT -gt 30 ] && rag pic_off $LEFT || echo "pic_off skipped: $LEFT s left" >> $R
grep -E "^\[|rc=|skipped|^ +32768 |_step_impl in" $R | sed 's/.*Finished/Finished/' | cut -c1-160
