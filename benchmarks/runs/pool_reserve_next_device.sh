#!/bin/bash
# Issue 28 (default pool vs XLA's memory limit), one device call (<= 6 min): the rag ttft engine
# (tulu3_block_ft, bf16, max_num_seqs 64, max_num_batched_tokens 8192, min bucket 128,
# position_free fcfs, default pool) started at max_model_len 40,960 with fresh compile caches
# (every variant compiled, none loaded), its warm-up log grepped for XLA's "Can't reduce memory
# use below ... by rematerialization" warning and, per compile, the limit XLA's
# rematerialisation got (VLOG of hlo_rematerialization.cc), then
# benchmarks/pool_reserve_probe.py's JSON: device memory (bytes_limit is XLA's base), pool
# blocks/GiB, the old rule's blocks (share_blocks), the step reserve, weights, and each variant's
# compiled memory analysis next to serving/cache/xla_limit.py's limit for it (limit_bytes: the
# figure the warning prints) and the peak XLA compares (peak_gib = temp + output; fits).
# Expected: 0 warnings and every variant fits; `limit_bytes` equal to the bytes of the VLOG'd /
# warned limits. A/B: SHARE=1 sizes the default pool by the old rule (memory share less the
# reserve only; on the H100 at MAX_LEN=33792 it warned "below 43.35GiB"): warnings, with
# limit_bytes equal to the warned bytes. BLOCKS=<n> starts the engine with an explicit pool.
# $OUT/pool_reserve${TAG}.txt. CPU check: JAX_PLATFORMS=cpu MODEL=tiny_llama OUT=/tmp/x bash <this>
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
export TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_rematerialization=1
R=$OUT/pool_reserve${TAG:-}.txt; L=$OUT/pool_reserve${TAG:-}_warmup.log; T0=$SECONDS
git log --oneline -1 > $R 2>/dev/null
timeout ${LIMIT:-330} python3 -m benchmarks.pool_reserve_probe --model ${MODEL:-tulu3_block_ft} \
  --max-model-len ${MAX_LEN:-40960} ${BLOCKS:+--num-kv-blocks $BLOCKS} ${SHARE:+--share-rule} \
  > $L 2>&1
echo "probe rc=$? t=$((SECONDS-T0)) s max_len=${MAX_LEN:-40960} share=${SHARE:-0}" >> $R
echo "remat warnings: $(grep -c 'by rematerialization' $L)" >> $R
grep 'by rematerialization' $L | sed 's/.*Can/Can/' | cut -c1-230 | head -20 >> $R
echo "XLA's limits (VLOG): $(grep -o 'HloRematerialization() with memory limit of [0-9.]*[KMGT]iB' \
  $L | awk '{print $NF}' | sort | uniq -c | tr '\n' ' ')" >> $R
grep -E '^\{"max_model_len"' $L >> $R
grep -E 'Error|rror:' $L | tail -5 | cut -c1-300 >> $R
cat $R
