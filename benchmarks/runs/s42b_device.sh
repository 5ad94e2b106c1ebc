#!/bin/bash
# Session 42's second call (any card, <= 4.5 min): the 0.8B decode token with the GDN decode
# kernel reading a, b, z from the layer's projection (qwen3_5_gdn.DECODE_GATES_IN_PROJ=1: no
# slice kernels for them, 54 fewer kernels a step; session 36c: 327 vs 381 kernels, busy 1.30
# vs 1.35 ms, undecided under the replays' noise) against today's form, one process each,
# alternating (benchmarks.decode_token_ms, the span engine's options, 8,192 blocks).
# usage: OUT=$OUT [ROUNDS=2] bash benchmarks/runs/s42b_device.sh
# (CPU smoke: MODEL=tiny_qwen3_5 OPTS='{"max_model_len": 1024, "num_kv_blocks": 256}'
#  JAX_PLATFORMS=cpu ROUNDS=1)
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s42b.txt
nvidia-smi -L > "$R" 2>/dev/null
OPTS=${OPTS:-'{"max_model_len": 25600, "max_num_seqs": 64, "max_num_batched_tokens": 1024, "num_kv_blocks": 8192}'}
for r in $(seq "${ROUNDS:-2}"); do
  for form in "" "DECODE_GATES_IN_PROJ=1"; do
    timeout 100 python3 -m benchmarks.decode_token_ms --model "${MODEL:-qwen3_5_0_8b}" \
      --options "$OPTS" --form "$form" --name "round $r" 2>&1 \
      | grep -E "ms a decode token|Error" | tail -1 | sed 's/; {.*//' >> "$R"
  done
done
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
