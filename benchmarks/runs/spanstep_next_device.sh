#!/bin/bash
# Issue 29 goal 1 (spans >= 1.0x prefix caching at 16 seats on multi and zipf), one H100/H200 call
# per step below (each <= 10 min): rag on qwen3_5_0_8b, bf16, run 3's flags at 16 seats:
#   bash benchmarks/runs/spanstep_next_device.sh fcfs      # fcfs before (6241c40) then after, ~2 x 4 min
#   bash benchmarks/runs/spanstep_next_device.sh pic_off   # the prefix-caching anchor (either tree), ~4 min
# "before" is the tree before s19-spanstep (the local pass's packed stream sized for every piece of
# the piece bound: 165 chunks = 10,560 rows per GDN layer at 1,024 tokens x 16 seats); "after" this
# tree (local_chunk_bound: 72 chunks = 4,608 rows; one conv window per row; the map store without a
# transposed copy; benchmarks/span_step_work.py counts both on CPU). Read: per workload req/s,
# computed tokens and ms/step of fcfs (before, after) against pic_off; the compose line (its share
# of the warm step, goal <= 5%). Same steps and tokens before and after (the CPU run of these flags
# on tiny_qwen3_5: multi 26 steps, 30,336 cached; zipf 41, 14,928 in both trees; same greedy tokens).
# Needs .git in the device copy (git archive), or BEFORE_TGZ= a git archive of 6241c40.
# CPU check (~3 min): PYTHON=/work/main/.venv/bin/python JAX_PLATFORMS=cpu MODEL=tiny_qwen3_5 DTYPE=float32 NREQ=8 bash <this> fcfs
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jcc_spanstep}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/before
BEFORE=6241c40
R="${PYTHON:-python3} -m benchmarks.cli rag --model ${MODEL:-qwen3_5_0_8b} --dtype ${DTYPE:-bfloat16}
  --num-requests ${NREQ:-24} --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024
  --max-num-seqs ${SEATS:-16} --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf
  --modes offline --max-tokens 8"
case "${1:-fcfs}" in
fcfs)
  if [ -n "${BEFORE_TGZ:-}" ]; then tar -xzf "$BEFORE_TGZ" -C /tmp/before
  else git archive $BEFORE | tar -x -C /tmp/before || { echo "no .git: BEFORE_TGZ="; exit 2; }; fi
  (cd /tmp/before && PYTHONPATH=/tmp/before timeout ${LIMIT:-280} $R --configs fcfs --compose-cost 1 \
    --out "$OUT/rag_before" > "$OUT/rag_fcfs_before.txt" 2>&1)
  timeout ${LIMIT:-280} $R --configs fcfs --compose-cost 1 --out "$OUT/rag_after" \
    > "$OUT/rag_fcfs_after.txt" 2>&1;;
after)  # this tree's fcfs + the pic_off anchor in one call (the goal's ratio), ~2 x 4 min
  timeout ${LIMIT:-280} $R --configs fcfs --compose-cost 1 --out "$OUT/rag_after" \
    > "$OUT/rag_fcfs_after.txt" 2>&1
  timeout ${LIMIT:-280} $R --configs pic_off --out "$OUT/rag_pic_off" > "$OUT/rag_pic_off.txt" 2>&1;;
pic_off)
  timeout ${LIMIT:-280} $R --configs pic_off --out "$OUT/rag_pic_off" > "$OUT/rag_pic_off.txt" 2>&1;;
esac
for f in "$OUT"/rag_*.txt; do echo "-- $f"; grep -E "requests/s|compose|rror" "$f" | cut -c1-300 | tail -8; done
${PYTHON:-python3} benchmarks/runs/rag_table.py --root "$OUT" before after pic_off  # steps, ms/step, computed
