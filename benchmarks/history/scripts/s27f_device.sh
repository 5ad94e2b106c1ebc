#!/bin/bash
# Session 27's last device call: the in-place initial states measured against the tree before
# them (8e2477e, unpacked into ./old_tree by `git archive 8e2477e | tar -x -C old_tree`), the
# step variants at rag's 1,024 tokens x 16 seats, one process each, back to back on one card.
set -u; T0=$SECONDS
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
ARGS="--time qwen3_5_0_8b --dtype bfloat16 --reps 9 --variants plain warm/0 warm/4"
(cd old_tree && PYTHONPATH=$PWD timeout 90 python3 -m benchmarks.span_step_work $ARGS 2>&1 \
  | grep "^time" | sed 's/^/before 8e2477e: /')
PYTHONPATH=$PWD timeout 90 python3 -m benchmarks.span_step_work $ARGS 2>&1 | grep "^time" \
  | sed 's/^/after: /'
echo "== t=$((SECONDS-T0)) s"
