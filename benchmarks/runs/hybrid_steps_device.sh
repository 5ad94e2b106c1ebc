#!/bin/bash
# Issue 29, one H100/H200 call (<= 4 min command time): where the reordered span request's time
# goes.
# `minipic-bench hybrid-spans --steps --sync-repeat` (benchmarks/hybrid_span_request.py, its
# steps: benchmarks/hybrid_span_steps.py) on qwen3_5_0_8b, bf16, the engine's default options:
# calls a-g as the goals run them (no extra sync), each with its engine steps summed per kind
# (host ms before dispatch, dispatch, read-back wait, dispatch-to-ready, device busy estimate,
# admission, slot/page moves, composition build/dispatch, page zeroing, Python GC, time outside the
# steps), then h / i = c / e again with every program waited for after its dispatch (exact device
# ms of the composition and of each step). Compare c with e row by row: c - e was 27 ms with no
# compile, but so were a - f (27 ms) and b - d (21 ms): each first call of its kind paid ~20-27 ms.
# Column `1st` counts the programs a kind ran for the first time after the warm-up (whose empty
# steps ran each once): if the extra sits in those rows only, it is a first real run (e.g. CUDA's
# lazy module loading of kernels the empty steps never launched: rerun with
# CUDA_MODULE_LOADING=EAGER in the environment, printed on the log's first lines).
# Raw JSON (rewritten after every call; per-step rows under rows.<call>.trace.steps):
# $OUT/hybrid_steps.json; the log: $OUT/hybrid_steps.txt; the per-call tables printed last.
# The warm-up (27 variants at 64 seats) compiles unless the step store / persistent cache under
# $JAX_COMPILATION_CACHE_DIR has them (a second call on the same warm machine loads them); if it
# overruns LIMIT the last progress line says how far it got.
# CPU check (~30-60 s):
#   PYTHON=/work/main/.venv/bin/python JAX_PLATFORMS=cpu MODEL=tiny_qwen3_5 DTYPE=float32 \
#   OUT=/tmp/hsteps HSPAN_EXTRA="--max-num-seqs 4 --max-num-batched-tokens 64 \
#   --min-token-bucket 64 --max-model-len 512 --block-size 16 --num-kv-blocks 96 \
#   --system-tokens 20 --spans 3 --span-tokens 40 --question-tokens 12 --long-span-tokens 100" \
#   bash benchmarks/runs/hybrid_steps_device.sh
set -u
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jcc_hspan}
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/hybrid_steps.txt; T0=$SECONDS
{ git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null
  echo "CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset (CUDA 12 default: LAZY)}"; } > "$R" 2>&1
timeout ${LIMIT:-225} ${PYTHON:-python3} -m benchmarks.cli hybrid-spans --steps --sync-repeat \
  --model ${MODEL:-qwen3_5_0_8b} --dtype ${DTYPE:-bfloat16} --json "$OUT/hybrid_steps.json" \
  ${HSPAN_EXTRA:-} >> "$R" 2>&1
echo "hybrid-spans --steps rc=$? t=$((SECONDS-T0)) s" >> "$R"
# the tables last: warm-up progress, start-up, each call and its steps, the goals, the exit line
grep -o "compiling step variant [0-9]*/[0-9]*" "$R" | tail -1
KEEP="CUDA_MODULE|minipic_jax: warm-up: [0-9]+ |hybrid-spans|start-up|call |[a-i] |    |goal "
grep -E "^($KEEP)" "$R" | tail -90
