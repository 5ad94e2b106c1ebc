#!/bin/bash
# Issue 29, one H100/H200 call (<= 5 min command time, fresh compile cache): the span request goals
# through `minipic-bench hybrid-spans` (benchmarks/hybrid_span_request.py) on qwen3_5_0_8b, bf16,
# the engine's default options (max_model_len sized for six 4,096-token spans): one engine started
# and warmed (seconds and variants reported), then a plain 5,720-token prompt, the
# [Prompt(200), Span(900) x 6, Prompt(120)] request cold, reordered with a new question, a second
# cold set and its reordering, a plain prompt again, and six 4,096-token spans; per call the
# generate wall ms, compiles (step variants, XLA compiles, XLA cache loads) and cached tokens;
# the goal lines last. Raw JSON (rewritten after every call): $OUT/hybrid_spans.json; the log:
# $OUT/hybrid_spans.txt. If the warm-up (27 variants at 64 seats on CPU) overruns LIMIT, the last
# progress line says how far it got; a second call on the same warm machine loads the compiled
# steps from $JAX_COMPILATION_CACHE_DIR's step store (its compiles then show as 0 at start).
# CPU check (~30-50 s):
#   PYTHON=/work/main/.venv/bin/python JAX_PLATFORMS=cpu MODEL=tiny_qwen3_5 DTYPE=float32 \
#   OUT=/tmp/hspan HSPAN_EXTRA="--max-num-seqs 4 --max-num-batched-tokens 64 \
#   --min-token-bucket 64 --max-model-len 512 --block-size 16 --num-kv-blocks 96 \
#   --system-tokens 20 --spans 3 --span-tokens 40 --question-tokens 12 --long-span-tokens 100" \
#   bash benchmarks/runs/hybrid_spans_next_device.sh
set -u
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jcc_hspan}
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/hybrid_spans.txt; T0=$SECONDS
{ git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null; } > "$R" 2>&1
timeout ${LIMIT:-285} ${PYTHON:-python3} -m benchmarks.cli hybrid-spans \
  --model ${MODEL:-qwen3_5_0_8b} --dtype ${DTYPE:-bfloat16} --json "$OUT/hybrid_spans.json" \
  ${HSPAN_EXTRA:-} >> "$R" 2>&1
echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
# the short table last: warm-up progress, start-up, the calls, the goals, the exit line
grep -o "compiling step variant [0-9]*/[0-9]*" "$R" | tail -1
grep -E "^(minipic_jax: warm-up: [0-9]+ step|hybrid-spans|start-up|call |[a-g] |goal )" "$R" \
  | tail -20
