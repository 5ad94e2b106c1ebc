#!/bin/bash
# Next device session, issue 27 ("no speed lost" after the cache-manager redesign, the sub-packages
# and the one step loop): the same benchmark on the tree before the redesign (8e11161, the last
# commit before serving/ was split) and on this tree, in one call, alternating.
#   bash benchmarks/runs/issue27_next_device.sh engine   # decode step vs floor, ~4 min
#   bash benchmarks/runs/issue27_next_device.sh rag      # rag rotated vs fcfs, 40 requests, ~8 min
# Also first: the compiled kernel tests after the CPU-only sessions (xla.py rewrite, the gated
# delta registry entry): `bash benchmarks/runs/issue27_next_device.sh tests` (~2 min).
# Needs .git in the device copy (git archive); each figure within 2% of "before" passes.
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=/tmp/jcc
# XLA's allocator takes 75% of the card by default: on an 80 GB H100 the decode bench's weights
# (16 GB) and pool (35.6 GB) did not leave room for its steps (both trees failed, 2026-12-05)
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/before
BEFORE=8e11161
if [ -n "${BEFORE_TGZ:-}" ]; then tar -xzf "$BEFORE_TGZ" -C /tmp/before  # git archive of $BEFORE's code
else git archive $BEFORE | tar -x -C /tmp/before || { echo "no .git here: carry a git archive of $BEFORE (BEFORE_TGZ=)"; exit 2; }; fi
# the archive has no benchmark data (added to git after $BEFORE): both trees read this tree's
mkdir -p /tmp/before/benchmarks/data && cp -n benchmarks/data/* /tmp/before/benchmarks/data/
case "${1:-engine}" in
tests)
  MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -o addopts= -p no:cacheprovider -n 4 \
    tests/test_paged_attention*.py tests/test_gated_delta.py tests/test_kernel_registry.py \
    tests/test_xla_attention_bounds.py tests/test_kernel_entry_points.py > "$OUT/compiled_tests.txt" 2>&1
  tail -3 "$OUT/compiled_tests.txt";;
engine)
  # BATCH=64 on an 80 GB H100: at 128 both trees ran out of memory filling the pool with random K/V
  # (2026-12-05, session 19); the H200 runs 128
  B="python3 -m benchmarks.cli engine --max-num-batched-tokens 512 --min-token-bucket 128 --skip-run --batch ${BATCH:-128}"
  for round in $(seq ${ROUNDS:-2}); do
    (cd /tmp/before && PYTHONPATH=/tmp/before timeout 110 $B --out "$OUT/engine_before_$round" > "$OUT/engine_before_$round.txt" 2>&1)
    timeout 110 $B --out "$OUT/engine_after_$round" > "$OUT/engine_after_$round.txt" 2>&1
  done
  for f in "$OUT"/engine_*.txt; do echo "-- $f"; grep -v "^W1\|^If this\|^Current alloc" "$f" | tail -3 | cut -c1-300; done;;
rag)
  R="python3 -m benchmarks.cli rag --configs rotated fcfs --workloads multi --modes offline --num-requests 40"
  (cd /tmp/before && PYTHONPATH=/tmp/before timeout 280 $R --out "$OUT/rag_before" > "$OUT/rag_before.txt" 2>&1)
  timeout 280 $R --out "$OUT/rag_after" > "$OUT/rag_after.txt" 2>&1
  for f in "$OUT"/rag_*.txt; do echo "-- $f"; tail -6 "$f"; done;;
esac
