#!/bin/bash
# The decode step of the 0.8B hybrid under step_command_buffer=on against the default, each in
# its own process on one host (session 40: the reordered span request's decodes are host-bound,
# 1.45 ms busy of ~3.4 ms a step). Per setting: an engine without warm-up, one 64-token prompt,
# generate with max_tokens 2 and 34 (EOS ignored), 5 times each after one untimed pair:
# ms per decode step = (t34 - t2) / 32, median.
# A setting `NAME:MODE` also sets XLA's command-buffer update mode for that process
# (XLA_FLAGS=--xla_gpu_command_buffer_update_mode=MODE: ALWAYS_UPDATE, the default, SKIP_TEMP or
# SKIP_PROFILED: XLA re-records or updates a graph whenever a buffer it names moved, and the
# step's int / float inputs are fresh device buffers every step).
# The measurement is benchmarks/decode_token_ms.py (the same one, inline when this ran).
# usage: OUT=$OUT [MODEL=qwen3_5_0_8b] [CBS="on xla on:SKIP_PROFILED"] \
#        bash benchmarks/runs/s40c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s40c.txt
nvidia-smi -L > "$R" 2>/dev/null
for item in ${CBS:-on xla}; do
  cb=${item%%:*}; mode=${item#"$cb"}; mode=${mode#:}
  flags=${XLA_FLAGS:-}; [ -n "$mode" ] && flags="$flags --xla_gpu_command_buffer_update_mode=$mode"
  XLA_FLAGS="$flags" python3 -m benchmarks.decode_token_ms --model "${MODEL:-qwen3_5_0_8b}" \
    --options "{\"max_model_len\": 1024, \"num_kv_blocks\": 256, \"step_command_buffer\": \"$cb\"}" \
    --name "step_command_buffer=$item" >> "$R" 2>&1
  echo "  rc=$? t=$((SECONDS-T0)) s" >> "$R"
done
cat "$R"
