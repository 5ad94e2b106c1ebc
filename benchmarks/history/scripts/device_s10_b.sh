#!/bin/bash
# Session 10, device call B (H200, <= 560 s): the cached-span TTFT with Pallas/Mosaic custom calls
# captured in XLA command buffers (CUDA graphs), then issue 19's call (i19_device_s9.sh).
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc MINIPIC_COMPILATION_CACHE_DIR=/tmp/jcc
T0=$SECONDS; git log --oneline -1 2>/dev/null
export XLA_FLAGS='--legacy_command_buffer_custom_call_targets=__gpu$xla.gpu.triton,mosaic_gpu_v2'
python3 -c "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(3)))" 2>&1 | tail -2
mkdir -p $OUT/cb; OUT=$OUT/cb timeout 240 bash benchmarks/history/scripts/ttft_device_s9.sh 2>&1 | tail -5
echo "ttft with command buffers t=$((SECONDS-T0))"; unset XLA_FLAGS
timeout 300 bash benchmarks/runs/i19_device_s9.sh; for d in /tmp/rag_*; do cp $d/rag_bench.json $OUT/$(basename $d).json; done 2>/dev/null
echo "i19 t=$((SECONDS-T0))"
