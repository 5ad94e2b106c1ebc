#!/bin/bash
# Session 37's second device call (one `run`, ~4 min, a short table last; any card): where the
# hybrid decode step's ~380 kernels go (t = 8, s = 8, every kernel: the design input of a fused
# decode layer), and the same step with XLA's Triton GEMMs off (cuBLAS for the small-M dots:
# `--xla_gpu_enable_triton_gemm=false`). The rag runs and issue 28's H200 call wait for the
# session's last call (its device minutes kept for the fused layer's compiled tests).
# usage: OUT=$OUT bash benchmarks/runs/s37b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s37b.txt
nvidia-smi -L > "$R" 2>/dev/null
timeout 120 python3 -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 \
  --tokens 128 --ckpt 1 --decode --reps 10 --profile 400 > "$OUT/decode_kernels.txt" 2>&1
echo "decode kernels rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|^profile decode t=[0-9]+ s=[0-9]+:" "$OUT/decode_kernels.txt" | cut -c1-160 >> "$R"
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 100 python3 -m benchmarks.fixed_step_work \
  --time --seats 64 --max-model-len 25600 --tokens 128 --ckpt 1 --decode --reps 10 \
  --profile 12 > "$OUT/decode_cublas.txt" 2>&1
echo "decode, Triton GEMMs off rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^time|^profile decode t=[0-9]+ s=[0-9]+:" "$OUT/decode_cublas.txt" | cut -c1-160 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
