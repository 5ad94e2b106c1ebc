#!/bin/bash
# Issue 29 item 3, one H100/H200 call (~3-4 min): the chain kernel (chain_triton.chain_apply) at every
# composition precision x (block_v, num_warps) next to the XLA loop (`python -m benchmarks.compose_forms`,
# no model: Qwen3.5-0.8B's map shapes, 30 maps on 3 rows), then the kernel's compiled tests. Session 20's
# rag run timed the kernel at "highest" (IEEE float32 FMA dots) at 0.53 TFLOP/s, 22x the loop: this picks
# the tensor-core precision and block that make it memory-bound (~0.4 ms for 30 applications).
# usage: OUT=$OUT bash benchmarks/runs/compose_sweep_device.sh
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
R=$OUT/compose_sweep.txt; T0=$SECONDS
{ git log --oneline -1; nvidia-smi -L; } > $R 2>/dev/null
timeout ${LIMIT:-300} python3 -m benchmarks.compose_forms 2>&1 | grep -E "compose form|compose kernel|rror" \
  | cut -c1-300 >> $R
echo "forms rc=${PIPESTATUS[0]} t=$((SECONDS-T0)) s" >> $R
MINIPIC_COMPILED=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_chain_compose_kernel.py \
  2>&1 | tail -4 >> $R
echo "tests t=$((SECONDS-T0)) s" >> $R
cat $R
