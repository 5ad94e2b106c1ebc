#!/bin/bash
# Session 23's second device call (one `run`, <= 9.5 min, a short table last; raw files under $OUT):
# the compiled tests of what changed since session 21's call A (the chain kernel's reset starts,
# the span-map store's zero_a flags, the two tests A failed and their fixes), rag at 16 seats
# (pic_off, fcfs, --compose-cost 1: the composition with and without zero heads), issue 29's span
# request (benchmarks.cli hybrid-spans, allocator preallocated), the plain and warm span steps
# profiled kernel by kernel (span_step_work --profile), then, within TOTAL, the plain
# hybrid step at 64 seats before (82b4d81) / after the flat checkpoint and restore rows (carry
# .dev1: `mkdir -p .dev1 && git archive -o .dev1/fixed_before.tgz 82b4d81`).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/history/scripts/s23_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s23
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s23.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
  tests/test_chain_compose_kernel.py tests/test_span_map_store.py tests/test_span_joint_pass.py \
  tests/test_hybrid_checkpoint_rows.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
L=$(left); [ "$L" -gt 150 ] && L=150
if [ "$L" -ge 60 ]; then
  OUT=$OUT LIMIT=$L bash benchmarks/runs/rag16_device.sh >> "$R"
fi
L=$(left); [ "$L" -gt 200 ] && L=200
if [ "$L" -ge 60 ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=true timeout $L python3 -m benchmarks.cli hybrid-spans --steps \
    --sync-repeat --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
  echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "^(call|[a-i] )|goal|warm-up" "$OUT/hybrid_spans.txt" | grep -v "^W1" | cut -c1-200 >> "$R"
fi
L=$(left); [ "$L" -gt 130 ] && L=130
if [ "$L" -ge 50 ]; then  # where a warm span step's extra time over a plain one goes
  timeout $L python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 5 \
    --variants plain warm/0 span --profile 14 > "$OUT/step_profile.txt" 2>&1
  echo "step profile rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "^(time|profile [a-z/0-9]+ new:)" "$OUT/step_profile.txt" >> "$R"
fi
L=$(left)
if [ "$L" -ge 80 ] && [ -f .dev1/fixed_before.tgz ]; then
  mkdir -p /tmp/kbefore && tar -xzf .dev1/fixed_before.tgz -C /tmp/kbefore
  EACH=$(( (L - 10) / 2 ))
  for tree in before after; do
    dir=$PWD; [ $tree = before ] && dir=/tmp/kbefore
    (cd $dir && PYTHONPATH=$dir OUT=/tmp/fixed_$tree SEATS=64 LENS=25600 LIMIT=$EACH \
      bash benchmarks/runs/fixed_step_device.sh > /dev/null 2>&1)
    echo "fixed step $tree t=$((SECONDS-T0)) s" >> "$R"
    grep "ms/step\|rc=[^0]" /tmp/fixed_$tree/fixed_step.txt | cut -c1-200 >> "$R"
  done
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
