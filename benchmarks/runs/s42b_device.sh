#!/bin/bash
# Session 42's second call (any card, <= 4.5 min): is XLA's concurrent-region flag
# (--xla_gpu_graph_enable_concurrent_region=true) faster for the 0.8B decode token, or was s42's
# one sample each (1.871 vs 1.980 ms default) noise? Default and region alternate, one process
# each (benchmarks.decode_token_ms, the span engine's options, 8,192 blocks), ABAB...
# usage: OUT=$OUT [ROUNDS=2] bash benchmarks/runs/s42b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s42b.txt
nvidia-smi -L > "$R" 2>/dev/null
OPTS=${OPTS:-'{"max_model_len": 25600, "max_num_seqs": 64, "max_num_batched_tokens": 1024, "num_kv_blocks": 8192}'}
for r in $(seq "${ROUNDS:-2}"); do
  for name in default region; do
    flags=""; [ "$name" = region ] && flags="--xla_gpu_graph_enable_concurrent_region=true"
    XLA_FLAGS="$flags" timeout 100 python3 -m benchmarks.decode_token_ms \
      --model "${MODEL:-qwen3_5_0_8b}" --options "$OPTS" --name "$name$r" 2>&1 \
      | grep -E "ms a decode token|Error" | tail -1 | cut -c1-120 >> "$R"
  done
done
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
