#!/bin/bash
# Next session (issue 19): after b50c9a6 (per-step hoisting of the hybrid step index/packing work), the same call as
# run 3 (benchmarks/history/gated_delta.md): compiled span-pass tests, rag fcfs then pic_off on qwen3_5_0_8b, compose cost. ~150 s.
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; T0=$SECONDS; rm -rf /tmp/rag_fcfs /tmp/rag_pic_off; MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_gated_delta_span_passes.py -k pallas 2>&1 | tail -2 | tee $OUT/compiled_tests.txt; LIMITS="90 0 118" bash benchmarks/runs/i19_device_s9.sh; python3 benchmarks/runs/rag_table.py | tee $OUT/table.txt; echo "total $((SECONDS-T0)) s"
