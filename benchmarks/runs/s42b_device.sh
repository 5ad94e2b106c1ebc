#!/bin/bash
# Session 42's second call (any card, ~5 min): two undecided program switches, A/B on one host.
#   1. checkpoint_pool.CHECKPOINTS_STACKED=0 (session 32, never timed): a prefill step's K = 16
#      checkpoint rows scattered layer by layer into the pool, not stacked [Lg, K, ...] (288 MiB
#      at 0.8B) and scattered once; the reordered 121-token prefill's two one-off whole-array
#      kernels (input_scatter_fusion_1 0.356 ms, loop_select_fusion_1 0.276, s42a) are likely
#      this stack and its scatter. The 64-seat 128-token prefill step with the pool,
#      alternated twice in one process (fixed_step_work --time --profile 4).
#   2. qwen3_5_gdn.DECODE_GATES_IN_PROJ=1: the GDN decode kernel reads a, b, z from the layer's
#      projection (no slice kernels for them: 54 fewer a step; session 36c 327 vs 381 kernels,
#      undecided under the replays' noise): the 0.8B decode token through generate, one
#      process each, alternating (benchmarks.decode_token_ms, the span engine's options);
#      with them XLA_FLAGS=--xla_gpu_enable_triton_gemm=false: the step's M = 8 GEMMs by cuBLAS
#      (XLA's Triton GEMMs ran 38-57% of HBM bandwidth there, s42a) instead of Triton.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s42b_device.sh
# (CPU smoke: MODEL=tiny_qwen3_5 SEATS=8 MML=1024 OPTS='{"max_model_len": 1024,
#  "num_kv_blocks": 256}' JAX_PLATFORMS=cpu TOTAL=120)
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s42b.txt
left() { echo $((${TOTAL:-420} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MODEL=${MODEL:-qwen3_5_0_8b}
timeout 150 python3 -m benchmarks.fixed_step_work --time --preset "$MODEL" --seats "${SEATS:-64}" \
  --max-model-len "${MML:-25600}" --tokens 128 --ckpt 1 --reps 15 --profile 4 \
  --forms "" CHECKPOINTS_STACKED=0 "" CHECKPOINTS_STACKED=0 > "$OUT/ckpt_store_ab.txt" 2>&1
echo "checkpoint store A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time |^profile prefill [^|]*:" "$OUT/ckpt_store_ab.txt" \
  | sed 's/live_prerotate=1 ck_form=barrier decode_in_place=2 //' | cut -c1-170 >> "$R"
OPTS=${OPTS:-'{"max_model_len": 25600, "max_num_seqs": 64, "max_num_batched_tokens": 1024, "num_kv_blocks": 8192}'}
r=0
while [ "$(left)" -gt 140 ]; do
  r=$((r + 1))
  for setting in ":" "DECODE_GATES_IN_PROJ=1:" ":--xla_gpu_enable_triton_gemm=false"; do
    form=${setting%%:*} flags=${setting#*:}
    XLA_FLAGS="$flags" timeout 100 python3 -m benchmarks.decode_token_ms --model "$MODEL" \
      --options "$OPTS" --form "$form" --name "round $r ${flags:-default flags}" 2>&1 \
      | grep -E "ms a decode token|Error" | tail -1 | sed 's/; {.*//' >> "$R"
  done
done
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
