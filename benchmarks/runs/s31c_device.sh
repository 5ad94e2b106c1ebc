#!/bin/bash
# The third device call of session 31 (<= 9 min, a short table last):
# 1. compiled engine tests that s31 could not pass (their pools were 2 blocks on the GPU: the
#    step's flat page view was counted as a copy of the pool, fixed in step_temps.VIEWS): the
#    engine with GDN_FINALS_IN_PLACE + DECODE_GATES_IN_PROJ, the in-place decode engine steps;
# 2. the default pool of that tiny engine on the GPU (blocks, reserve) after the fix;
# 3. what the 1,024-token plain step's one 0.70 ms cuBLAS GEMM and its 18 loop_convert_select
#    fusions (0.67 ms) are: span_step_work's plain step dumped, its GEMM calls and those
#    fusions' HLO lines;
# 4. the 64-seat decode step, DECODE_GATES_IN_PROJ off / on alternated twice (s31: time 1.88
#    vs 2.15 ms but first-to-last 2.42 vs 2.26: undecided).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s31c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s31
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s31c.txt
left() { echo $((${TOTAL:-540} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 timeout 150 python3 -m pytest -v -p no:cacheprovider \
  -o addopts= -rfE -n 3 tests/test_finals_in_place.py tests/test_gdn_decode_kernel.py \
  -k "engine" > "$OUT/tests.txt" 2>&1
echo "compiled engine tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt" | cut -c1-120)" >> "$R"
grep -E "(FAILED|ERROR) |^E  " "$OUT/tests.txt" | cut -c1-220 | sort -u | head -12 >> "$R"
timeout 60 python3 - >> "$R" 2>"$OUT/pool_err.txt" <<'PY'
from minipic_jax import LLM
llm = LLM("tiny_qwen3_5", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
          decode_attn_impl="triton_decode", warmup=False, step_cache="off")
r = llm.llm_engine.runner
print(f"tiny_qwen3_5 default pool on the GPU: {r.num_blocks} blocks, step reserve "
      f"{r.step_reserve / 2**20:.1f} MiB")
PY
echo "pool check rc=$? t=$((SECONDS-T0)) s" >> "$R"
D=/tmp/dump_s31c; rm -rf $D
XLA_FLAGS="--xla_dump_to=$D --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \
  timeout 120 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 3 \
  --variants plain --forms new > "$OUT/dump_run.txt" 2>&1
echo "plain step dump rc=$? t=$((SECONDS-T0)) s" >> "$R"
F=$(ls -S $D/*after_optimizations.txt 2>/dev/null | head -1)
if [ -n "$F" ]; then
  grep -E "custom_call_target=\"__cublas" "$F" | cut -c1-330 > "$OUT/gemms.txt"
  grep -E "^\s*(ROOT )?%?loop_convert_select_fusion[.0-9_]* = " "$F" | cut -c1-400 > "$OUT/select.txt"
  echo "gemm calls $(wc -l < "$OUT/gemms.txt"), loop_convert_select $(wc -l < "$OUT/select.txt")" >> "$R"
  awk '{print length($0) > 0 ? substr($0, 1, 260) : ""}' "$OUT/gemms.txt" | sort | uniq -c | sort -rn | head -8 >> "$R"
  head -3 "$OUT/select.txt" | cut -c1-300 >> "$R"
  python3 -m benchmarks.hlo_kernels "$F" --top 12 > "$OUT/hlo_kernels.txt" 2>&1
  head -16 "$OUT/hlo_kernels.txt" >> "$R"
  gzip -c "$F" > "$OUT/plain_step_hlo.txt.gz"
fi
L=$(left); [ "$L" -gt 200 ] && L=200
[ "$L" -ge 100 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 --ckpt 1 --decode --reps 15 --profile 4 \
  --forms "" DECODE_GATES_IN_PROJ=1 "" DECODE_GATES_IN_PROJ=1 > "$OUT/decode_ab.txt" 2>&1
echo "decode A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live_prerotate|^time .*decode|^profile decode [^|]*:" "$OUT/decode_ab.txt" | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
