#!/bin/bash
# Issue 28 (default pool vs XLA's memory), one H200 call (<= 6 min): the rag ttft engine (tulu3_block_ft,
# bf16, max_num_seqs 64, max_num_batched_tokens 8192, min bucket 128, position_free fcfs, default pool)
# started at max_model_len 40,960 with fresh compile caches (every variant compiled, none loaded), its
# warm-up log grepped for XLA's "Can't reduce memory use below ... by rematerialization" warning, then
# benchmarks/pool_reserve_probe.py's JSON: device memory, pool blocks/GiB, the step reserve
# (serving/cache/step_temps.py), weights, and each variant's compiled memory analysis. $OUT/pool_reserve.txt.
# Before the fix the same command warned (the pool ~95 GB left no room for the overflow variants'
# ~26-31 GiB gather); after it: 0 warnings expected, pool smaller by the reserve.
# A/B: BLOCKS=<the old default's num_blocks> starts the same engine with the old pool size.
# CPU check: JAX_PLATFORMS=cpu MODEL=tiny_llama OUT=/tmp/x bash <this>
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
R=$OUT/pool_reserve.txt; L=$OUT/pool_reserve_warmup.log; T0=$SECONDS
git log --oneline -1 > $R 2>/dev/null
timeout ${LIMIT:-330} python3 -m benchmarks.pool_reserve_probe --model ${MODEL:-tulu3_block_ft} \
  --max-model-len ${MAX_LEN:-40960} ${BLOCKS:+--num-kv-blocks $BLOCKS} > $L 2>&1
echo "probe rc=$? t=$((SECONDS-T0)) s" >> $R
echo "remat warnings: $(grep -c 'by rematerialization' $L)" >> $R
grep 'by rematerialization' $L | cut -c1-300 | head -20 >> $R
grep -E '^\{"max_model_len"' $L >> $R
grep -E 'Error|rror:' $L | tail -5 | cut -c1-300 >> $R
cat $R
