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
# usage: OUT=$OUT [MODEL=qwen3_5_0_8b] [CBS="on xla on:SKIP_PROFILED"] \
#        bash benchmarks/runs/s40c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s40c.txt
nvidia-smi -L > "$R" 2>/dev/null
for item in ${CBS:-on xla}; do
  cb=${item%%:*}; mode=${item#"$cb"}; mode=${mode#:}
  flags=${XLA_FLAGS:-}; [ -n "$mode" ] && flags="$flags --xla_gpu_command_buffer_update_mode=$mode"
  XLA_FLAGS="$flags" python3 - "$item" "${MODEL:-qwen3_5_0_8b}" >> "$R" 2>&1 <<'PY'
import statistics, sys, time
import jax
from minipic_jax import LLM, SamplingParams
item, model = sys.argv[1], sys.argv[2]
cb = item.split(":")[0]
dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
t0 = time.perf_counter()
llm = LLM(model, dtype=dtype, seed=0, warmup=False, max_model_len=1024, num_kv_blocks=256,
          step_command_buffer=cb)
start = time.perf_counter() - t0
prompt = {"prompt_token_ids": list(range(1, 65))}
def timed(n):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter(); llm.generate([prompt], sp, use_tqdm=False)
    return time.perf_counter() - t
timed(2); timed(34)
per = sorted((timed(34) - timed(2)) / 32 * 1e3 for _ in range(5))
print(f"step_command_buffer={item}: {statistics.median(per):.3f} ms a decode step "
      f"(min {per[0]:.3f}, max {per[-1]:.3f}; {jax.devices()[0].device_kind}; start {start:.1f} s)")
PY
  echo "  rc=$? t=$((SECONDS-T0)) s" >> "$R"
done
cat "$R"
