#!/bin/bash
# Session 10: the cached-span TTFT with XLA command buffers (CUDA graphs) widened to custom calls
# and one-op graphs; skipped if the plugin rejects a flag. Writes $OUT/cmdbuf/. (~180 s)
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc MINIPIC_COMPILATION_CACHE_DIR=/tmp/jcc
F="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
if XLA_FLAGS="$F" timeout 60 python3 -c "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()" > /tmp/flagcheck.txt 2>&1; then
  mkdir -p $OUT/cmdbuf; XLA_FLAGS="$F" OUT=$OUT/cmdbuf bash benchmarks/history/scripts/ttft_device_s9.sh 2>&1 | tail -5
else echo "flags rejected: $(grep -o 'Unknown flag.*' /tmp/flagcheck.txt | head -1)"; fi
