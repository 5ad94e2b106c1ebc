#!/bin/bash
# Issue 28 (default pool vs XLA's memory limit), one device call (<= 6 min): the rag ttft engine
# (tulu3_block_ft, bf16, max_num_seqs 64, max_num_batched_tokens 8192, min bucket 128,
# position_free fcfs, default pool) started at max_model_len 40,960 with fresh compile caches
# (every variant compiled, none loaded), its warm-up log grepped for XLA's "Can't reduce memory
# use below ... by rematerialization" warning and, per compile, the limit XLA's
# rematerialisation got (VLOG of hlo_rematerialization.cc), then
# benchmarks/pool_reserve_probe.py's JSON: device memory (bytes_limit is XLA's base), pool
# blocks/GiB, the XLA-limit cap's blocks (xla_blocks), the step reserve, weights, and each variant's
# compiled memory analysis next to serving/cache/xla_limit.py's limit for it (limit_bytes: the
# figure the warning prints) and the peak XLA compares (peak_gib = temp + weights + outputs; fits).
# What to compare: the VLOG'd "memory limit of X" of each step compile against the variants'
# limit_gib, and "Peak memory usage of module (before)" against the traced peaks (`traced`).
# Measured (H100, 2026-12-05, cap off, max_model_len 40,960): 0 warnings but XLA
# rematerialised the top step (limit 43.26 GiB = xla_limit.py's, peak 47.85 -> under 43.26):
# pool 21.13 GiB, weights 14.96, XLA's temporaries 11.77 GiB before, 6.51 after. XLA_RULE=1 turns
# kv_pool.CAP_BY_XLA_LIMIT on (the A/B); XLA_LIMIT=exact gives the steps the exact slop factor
# (Config.compilation.xla_memory_limit, session 19: the pool as before, XLA told the truth); BLOCKS=<n> starts the engine with an explicit pool.
# $OUT/pool_reserve${TAG}.txt. CPU check: JAX_PLATFORMS=cpu MODEL=tiny_llama MAX_LEN=2048 OUT=/tmp/x bash <this>
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
export TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_rematerialization=1
mkdir -p "$OUT"; R=$OUT/pool_reserve${TAG:-}.txt; L=$OUT/pool_reserve${TAG:-}_warmup.log; T0=$SECONDS
git log --oneline -1 > $R 2>/dev/null
timeout ${LIMIT:-330} python3 -m benchmarks.pool_reserve_probe --model ${MODEL:-tulu3_block_ft} \
  --max-model-len ${MAX_LEN:-40960} ${BLOCKS:+--num-kv-blocks $BLOCKS} ${XLA_RULE:+--xla-rule} \
  ${XLA_LIMIT:+--xla-memory-limit $XLA_LIMIT} \
  > $L 2>&1
echo "probe rc=$? t=$((SECONDS-T0)) s max_len=${MAX_LEN:-40960} xla_rule=${XLA_RULE:-0} xla_limit=${XLA_LIMIT:-xla} card: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)" >> $R
echo "remat warnings: $(grep -c 'by rematerialization' $L)" >> $R
grep 'by rematerialization' $L | sed 's/.*Can/Can/' | cut -c1-230 | head -20 >> $R
grep -h -E "with memory limit of|Adjusted memory limit|Peak memory usage of module" $L \
  | sed 's/.*\] //' | sort | uniq -c | head -60 >> $R
grep -E '^\{"max_model_len"' $L >> $R
grep -E 'Error|rror:' $L | tail -5 | cut -c1-300 >> $R
cat $R
