#!/bin/bash
# Next device call, session 19 "lower": the K/V write and the GDN prefill kernels under their own jit
# (traced and lowered once per step variant, not per layer), and each variant compiled as soon as it
# is lowered. One call (~7 min on the H100; ROUNDS=2 needs a second call's time):
#   1. the compiled tests of the two wrapped paths (write_kv, GDN ragged prefill, the engine's GDN
#      kernel, test_step_lowering) (~2 min);
#   2. the decode bench's warm-up (llama3_8b, 10 variants) on the tree before (6241c40) and this
#      one, alternating: the `start-up:` line (trace / lower / compile / store; compile is now the
#      wait after the last lowering) and the decode step (must stay within noise: the program is
#      the same, test_step_lowering.py).
# usage: OUT=$OUT bash benchmarks/runs/lower_next_device.sh   (needs .git, or BEFORE_TGZ= a git
# archive of 6241c40 carried)
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/before
BEFORE=6241c40
if [ -n "${BEFORE_TGZ:-}" ]; then tar -xzf "$BEFORE_TGZ" -C /tmp/before
else git archive $BEFORE | tar -x -C /tmp/before || { echo "no .git: carry BEFORE_TGZ"; exit 2; }; fi
if [ -z "${SKIP_TESTS:-}" ]; then MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -o addopts= -p no:cacheprovider \
  -n 4 -rfE tests/test_paged_attention_write.py tests/test_gated_delta.py \
  tests/test_engine_gdn_kernel.py tests/test_step_lowering.py > "$OUT/compiled_tests.txt" 2>&1
  echo "compiled tests rc=$?"; grep -E "^(FAILED|ERROR) " "$OUT/compiled_tests.txt" | head; tail -1 "$OUT/compiled_tests.txt"
fi  # SKIP_TESTS=1: next_device.sh Y ran them
B="python3 -m benchmarks.cli engine --max-num-batched-tokens 512 --min-token-bucket 128 --skip-run --batch ${BATCH:-64}"
for round in $(seq ${ROUNDS:-1}); do
  for tree in before after; do  # a fresh persistent cache each run: every variant compiled
    dir=$PWD; [ $tree = before ] && dir=/tmp/before
    (cd $dir && PYTHONPATH=$dir JAX_COMPILATION_CACHE_DIR=/tmp/jcc_${tree}_$round timeout ${LIMIT:-150} \
      $B --out "$OUT/engine_${tree}_$round" > "$OUT/engine_${tree}_$round.txt" 2>&1)
    echo "-- $tree $round"; grep -E "start-up|warm-up readied|^decode batch" "$OUT/engine_${tree}_$round.txt" \
      | grep -v "^W1" | tail -4 | cut -c1-400
  done
done
