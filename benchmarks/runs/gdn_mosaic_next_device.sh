#!/bin/bash
# Issue 29 item 5, first device run of the Mosaic GPU intra-chunk solve (intra_mosaic.py): its
# compiled tests, then the bf16 32K prefill with it (fused_mosaic) vs fla and vs the Triton
# pipeline (fused), and kernel 1 alone (Triton blocked vs Mosaic, 3 and 1 passes). ~3 min;
# carry .whl (fla + torch wheels, as gdn_next_device.sh).
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc XLA_PYTHON_CLIENT_PREALLOCATE=false; R=$PWD
python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$R:/tmp/site
MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 70 python3 -m pytest -v -rfE -p no:cacheprovider -o addopts= tests/test_gated_delta_mosaic.py > $OUT/mosaic_tests.txt 2>&1
B="python3 -m benchmarks.cli gdn --tokens 32768 --reps 5"
timeout 60 $B --no-fla --variants intra_only_blocked intra_only_mosaic intra_only_mosaic_p1 > $OUT/bench_intra.txt 2>&1
timeout 80 $B --variants fused fused_mosaic > $OUT/bench_fused.txt 2>&1
echo "== expected: tests all passed; intra_only_mosaic well under intra_only_blocked (0.60 ms on the H200), roofline ~0.14 ms (memory); fused_mosaic = fused - (blocked - mosaic)"
echo "mosaic_tests: $(grep -E '^=+ .*(passed|failed).* =+$' $OUT/mosaic_tests.txt | tail -1)"; grep -E '^(FAILED|ERROR) ' $OUT/mosaic_tests.txt
grep -hE "^E +(AssertionError|ValueError|Max abs|Mismatch)" $OUT/mosaic_tests.txt | head -4
for f in bench_intra bench_fused; do echo "-- $f"; grep -E "^ +32768 " $OUT/$f.txt 2>/dev/null || tail -3 $OUT/$f.txt 2>/dev/null; done
