#!/bin/bash
# Issue 29 item 5, first device run of the Mosaic GPU kernels (intra_mosaic.py, output_mosaic.py):
# their compiled tests (slow ones included), kernel 1 alone (Triton blocked vs Mosaic, block
# products in 3 and 1 passes), then the bf16 32K prefill vs fla: fused (all Triton),
# fused_mosaic (Mosaic solve) and fused_mosaic_out (Mosaic solve and output). ~3 min; carry
# .whl (fla + torch wheels, as gdn_next_device.sh).
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc XLA_PYTHON_CLIENT_PREALLOCATE=false; R=$PWD
timeout 60 python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$R:/tmp/site
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 JAX_PLATFORMS=cuda timeout 75 python3 -m pytest -v -rfE -p no:cacheprovider -o addopts= tests/test_gated_delta_mosaic.py > $OUT/mosaic_tests.txt 2>&1
B="python3 -m benchmarks.cli gdn --tokens 32768 --reps 5"
timeout 45 $B --no-fla --variants intra_only_blocked intra_only_mosaic intra_only_mosaic_p1 > $OUT/bench_intra.txt 2>&1
timeout 80 $B --variants fused fused_mosaic fused_mosaic_out > $OUT/bench_fused.txt 2>&1
echo "== expected: tests all passed; intra_only_mosaic ~0.2-0.3 ms (Triton blocked 0.60; floors: memory 0.14, tensor 0.16 ms, p1 0.11); fused_mosaic_out ~0.9-1.0 ms (<= 0.8x fla: output floor 0.17 ms)"
echo "mosaic_tests: $(grep -E '^=+ .*(passed|failed).* =+$' $OUT/mosaic_tests.txt | tail -1)"; grep -E '^(FAILED|ERROR) ' $OUT/mosaic_tests.txt
grep -hE "^E +(AssertionError|ValueError|Max abs|Mismatch)" $OUT/mosaic_tests.txt | head -4
for f in bench_intra bench_fused; do echo "-- $f"; grep -E "^ +32768 " $OUT/$f.txt 2>/dev/null || tail -3 $OUT/$f.txt 2>/dev/null; done
