#!/bin/bash
# Issue 29, one H100/H200 call (~3-5 min, fresh compile cache): device ms of the plain prefill
# step of qwen3_5_0_8b bf16 (random weights, warmup off, its real kernels) at t in {128, 1024} x
# seats in {16, 64} x max_model_len in {4096, 25600}, prefix caching on (the engine's default:
# the checkpoint pool attached), each seats x max_model_len a fresh process (one engine, one
# compile per bucket, then the median of REPS replays waited for). With CAPS="1 0" also with
# prefix caching off (no checkpoint outputs: the term benchmarks/fixed_step_work.py --count finds).
# Run it on the tree before and after a change (same machine) to time the change. CPU check:
#   PYTHON=/work/main/.venv/bin/python JAX_PLATFORMS=cpu MODEL=tiny_qwen3_5 SEATS="4" LENS="512" \
#   TOKENS="16 64" REPS=2 BLOCKS=256 OUT=/tmp/fixed_dev bash benchmarks/runs/fixed_step_device.sh
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/fixed_step.txt; T0=$SECONDS
{ git log --oneline -1 2>/dev/null; nvidia-smi -L 2>/dev/null; } > "$R" 2>&1
for cap in ${CAPS:-1}; do
  for seats in ${SEATS:-16 64}; do
    for len in ${LENS:-4096 25600}; do
      timeout ${LIMIT:-100} ${PYTHON:-python3} -m benchmarks.fixed_step_work --time \
        --preset ${MODEL:-qwen3_5_0_8b} --seats $seats --max-model-len $len \
        --tokens ${TOKENS:-128 1024} --ckpt $cap --reps ${REPS:-10} \
        --num-kv-blocks ${BLOCKS:-4096} >> "$R" 2>&1
      echo "caching=$cap seats=$seats max_model_len=$len rc=$? t=$((SECONDS-T0)) s" >> "$R"
    done
  done
done
grep "ms/step\|rc=[^0]" "$R"
