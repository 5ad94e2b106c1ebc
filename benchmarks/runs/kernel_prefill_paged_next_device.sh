#!/bin/bash
# Next H200 call, issue 28 item 2 (the cached-span step without the key pre-pass): the compiled
# tests of the paged-keys prefill kernel (mosaic_prefill_paged.py; the rotating cases run compiled
# only), then the cached-span attention call (72 rows over 8 x 4096 position-free cached keys,
# Llama-3.1-8B heads) with the current path (dv+idle: keys-only pre-pass + split kernel, values
# from the pages) against paged_k (no pre-pass), checked against the float64 reference, ABBA wall
# time and per-kernel profile (benchmarks/cached_span_attention.py prints the table).
#   bash benchmarks/runs/kernel_prefill_paged_next_device.sh        # ~4 min
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=/tmp/jcc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -o addopts= -p no:cacheprovider \
  tests/test_paged_attention_paged_keys.py tests/test_paged_attention_mixed.py \
  tests/test_paged_attention_mgpu_prefill.py > "$OUT/compiled_tests.txt" 2>&1
tail -5 "$OUT/compiled_tests.txt"
timeout 300 python3 -m benchmarks.cached_span_attention --variants dv+idle,paged_k --reference \
  --out "$OUT/cached_span_paged_k.json" 2>&1 | tee "$OUT/cached_span_paged_k.txt" | tail -6
