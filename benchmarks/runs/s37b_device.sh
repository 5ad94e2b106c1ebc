#!/bin/bash
# Session 37's second device call (one `run`, <= 9.5 min, a short table last). By card:
#   H200: issue 28's first H200 call (`issue28_h200.sh 1`: the cached-span TTFT through
#         LLM.generate, host ms, then the exact XLA limit at max_model_len 40,960); no H200 ran
#         issue 28's measures since session 20.
#   H100: issue 29 with session 37's defaults (decode_rows.ROWS_IN_KERNEL and
#         span_maps.STORE_SMALL_STACKED on): rag at 16 seats three times in one process each
#         (s36d / s37: a process's first run is slow, one pair does not resolve zipf's 1.0x), then
#         every kernel of the hybrid decode step (t = 8, s = 8: where its ~380 kernels go, for a
#         fused decode layer) and the same step with XLA's Triton GEMMs off (cuBLAS for the
#         small-M dots: `--xla_gpu_enable_triton_gemm=false`).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s37b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s37b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
if grep -q H200 "$R"; then
  OUT=$OUT bash benchmarks/runs/issue28_h200.sh 1 > "$OUT/issue28_1_run.txt" 2>&1
  echo "issue28_h200.sh 1 rc=$? t=$((SECONDS-T0)) s" >> "$R"
  tail -30 "$OUT/issue28_1_run.txt" | cut -c1-220 >> "$R"
else
  for i in 1 2 3; do
    L=$(left); L=$((L - 170)); [ "$L" -gt 100 ] && L=100
    [ "$L" -ge 60 ] && OUT=$OUT LIMIT=$L NAME=rag_$i COMPOSE=0 \
      bash benchmarks/runs/rag16_device.sh >> "$R"
  done
  L=$(left); L=$((L - 75)); [ "$L" -gt 110 ] && L=110
  [ "$L" -ge 50 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
    --max-model-len 25600 --tokens 128 --ckpt 1 --decode --reps 10 --profile 400 \
    > "$OUT/decode_kernels.txt" 2>&1
  echo "decode kernels rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "^time|^profile decode t=[0-9]+ s=[0-9]+:" "$OUT/decode_kernels.txt" | cut -c1-160 >> "$R"
  L=$(left); [ "$L" -gt 90 ] && L=90
  [ "$L" -ge 45 ] && XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout $L python3 -m \
    benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 --tokens 128 --ckpt 1 \
    --decode --reps 10 --profile 12 > "$OUT/decode_cublas.txt" 2>&1
  echo "decode, Triton GEMMs off rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "^time|^profile decode t=[0-9]+ s=[0-9]+:" "$OUT/decode_cublas.txt" | cut -c1-160 >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
# few files come back from a call: the JSONs in one archive
(cd "$OUT" && find . -name "*.json" | tar czf raw_json.tgz -T - && find . -name "*.json" -delete)
cat "$R"
