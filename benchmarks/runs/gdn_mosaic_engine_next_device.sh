#!/bin/bash
# Issue 29 item 5, the engine side: the hybrid engine with the Mosaic GPU gated delta kernels
# (Config.gdn.impl / gdn_impl). Its tests compiled (the slow one included: the model's float32
# q/k through the Mosaic ragged path vs XLA; a tiny bf16 engine, mosaic vs xla tokens), then the
# Qwen3.5-0.8B preset engine (random bf16 weights), 8 prompts x 2048 tokens + 8 greedy tokens,
# gdn kernel pallas_fused vs mosaic: greedy tokens equal, max |dlogprob|, the 2048-token prefill
# step alone (ms), with a flushed progress line per phase of each engine (start, first generate =
# its compiles, timed generate, prefill step) so a timeout shows where it stood. At most 6 min
# (timeouts 60 + 290 s); no wheels. The last run (180 s) printed nothing for mosaic: each GDN layer
# compiled its own two Mosaic kernels (36 per step variant), one per shape since 5f778f8.
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc XLA_PYTHON_CLIENT_PREALLOCATE=false
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 JAX_PLATFORMS=cuda timeout 60 python3 -m pytest -v -rfE -p no:cacheprovider -o addopts= tests/test_engine_gdn_kernel.py > $OUT/engine_gdn_tests.txt 2>&1
JAX_PLATFORMS=cuda timeout 290 python3 -m benchmarks.cli gdn-engine --json > $OUT/gdn_engine_ab.txt 2>&1
echo "== expected: tests all passed; gdn-engine: mosaic greedy tokens 8/8 equal to pallas_fused (or max |dlogprob| < 2e-2 where a near-tie flips), its prefill step below pallas_fused's (kernel: fused_mosaic_out vs fused, gdn_mosaic_next_device.sh)"
echo "engine_gdn_tests: $(grep -E '^=+ .*(passed|failed).* =+$' $OUT/engine_gdn_tests.txt | tail -1)"; grep -E '^(FAILED|ERROR) ' $OUT/engine_gdn_tests.txt
grep -hE "^E +(AssertionError|ValueError|RuntimeError|Max abs|Mismatch)" $OUT/engine_gdn_tests.txt | head -4
echo "-- gdn_engine_ab"; grep -E "^gdn(-engine)? " $OUT/gdn_engine_ab.txt || tail -5 $OUT/gdn_engine_ab.txt
