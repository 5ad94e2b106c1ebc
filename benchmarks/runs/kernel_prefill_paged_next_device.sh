#!/bin/bash
# Next H200 call, issue 28 item 2 (the cached-span step without the key pre-pass).
# 1. The paged-keys kernel's compiled tests first, alone, under a short timeout, with ptxas's
#    report dumped: the rotating cases now also pass interpreted (the CPU hang was the XLA CPU
#    pool, kernels_pallas/paged_attention/interpret_threads.py, not the barrier protocol), so a
#    timeout here would be a compiled-only fault: the script stops there. The ptxas lines show
#    whether the 216/72 register split spills (the memory warpgroup's rotation holds four
#    [64, 64] float32 operands, 128 values a thread, against 72 registers).
# 2. The other compiled prefill/mixed tests.
# 3. The cached-span attention call (72 rows over 8 x 4096 position-free cached keys,
#    Llama-3.1-8B heads): dv+idle (keys-only pre-pass + split kernel) against paged_k (no
#    pre-pass), checked against the float64 reference, ABBA wall time and per-kernel profile.
#   bash benchmarks/runs/kernel_prefill_paged_next_device.sh        # ~4 min (at most ~8)
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=/tmp/jcc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ptxas"
PYTEST="python3 -m pytest -q -o addopts= -p no:cacheprovider"
MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptxas" \
  timeout 120 $PYTEST -s tests/test_paged_attention_paged_keys.py > "$OUT/paged_keys_tests.txt" 2>&1
rc=$?
tail -5 "$OUT/paged_keys_tests.txt"
echo "ptxas (registers / spills, per kernel):"
# (MOSAIC_GPU_DUMP_TO names the folder; a build that prints the report instead puts it in the log)
grep -rhoi "used [0-9]* registers\|[0-9]* bytes spill [a-z]*" "$OUT/ptxas" "$OUT/paged_keys_tests.txt" \
  | sort | uniq -c | head -20
if [ "$rc" = 124 ]; then echo "paged-keys tests TIMED OUT (compiled hang?): stopping"; exit 1; fi
MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 150 $PYTEST \
  tests/test_paged_attention_mixed.py tests/test_paged_attention_mgpu_prefill.py \
  > "$OUT/compiled_tests.txt" 2>&1
tail -3 "$OUT/compiled_tests.txt"
timeout 240 python3 -m benchmarks.cached_span_attention --variants dv+idle,paged_k --reference \
  --out "$OUT/cached_span_paged_k.json" 2>&1 | tee "$OUT/cached_span_paged_k.txt" | tail -6
