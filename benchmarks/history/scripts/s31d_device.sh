#!/bin/bash
# A short device call (session 31, <= 4 min): the compiled engine tests that s31 could not pass
# (2-block pools, fixed in step_temps.VIEWS) and the tiny engine's default pool on the GPU.
# usage: OUT=$OUT bash benchmarks/history/scripts/s31d_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s31d.txt
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 170 python3 -m pytest -v -p no:cacheprovider \
  -o addopts= -rfE -n 3 tests/test_finals_in_place.py tests/test_gdn_decode_kernel.py \
  -k "engine" > "$OUT/tests.txt" 2>&1
echo "compiled engine tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt" | cut -c1-120)" >> "$R"
grep -E "(PASSED|FAILED|ERROR) |^E  " "$OUT/tests.txt" | cut -c1-200 | sort -u | head -14 >> "$R"
timeout 50 python3 - >> "$R" 2>"$OUT/pool_err.txt" <<'PY'
from minipic_jax import LLM
llm = LLM("tiny_qwen3_5", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
          decode_attn_impl="triton_decode", warmup=False, step_cache="off")
r = llm.llm_engine.runner
print(f"tiny_qwen3_5 default pool on the GPU: {r.num_blocks} blocks, step reserve "
      f"{r.step_reserve / 2**20:.1f} MiB")
PY
echo "pool check rc=$? t=$((SECONDS-T0)) s; $(tail -1 "$OUT/pool_err.txt" | cut -c1-200)" >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
