#!/bin/bash
# First device call of the next session (issue 19): compiled GDN tests and the bf16 32K prefill
# after b7680ba (bf16 kernels back to their 2154e46 form), vs fla and vs the 2154e46 kernels. ~150 s; carry .whl.
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc XLA_PYTHON_CLIENT_PREALLOCATE=false; R=$PWD
python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$R:/tmp/site
MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 60 python3 -m pytest -v -rfE -p no:cacheprovider -o addopts= -n 4 tests/test_gated_delta.py tests/test_gated_delta_decay_precision.py > $OUT/gdn_tests.txt 2>&1
B="python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 --variants fused"
timeout 75 $B > $OUT/bench_new.txt 2>&1
mkdir -p /tmp/old && git archive 2154e46 kernels_pallas 2>/dev/null | tar -x -C /tmp/old && (cd /tmp/old && PYTHONPATH=/tmp/old:$PYTHONPATH timeout 45 $B --no-fla > $OUT/bench_old.txt 2>&1)
echo "== expected: tests 26 passed 2 skipped; fused ~1.35 ms (~1.08x fla), same as 2154e46 (b3051d3 was 1.451 = 1.17x)"
echo "gdn_tests: $(grep -E '^=+ .*(passed|failed).* =+$' $OUT/gdn_tests.txt | tail -1)"; grep -E '^(FAILED|ERROR) ' $OUT/gdn_tests.txt
grep -hE "^E +(AssertionError|Max abs|Mismatch)" $OUT/gdn_tests.txt | head -4
for f in bench_new bench_old; do echo "-- $f"; grep -E "^ +32768 " $OUT/$f.txt 2>/dev/null || tail -2 $OUT/$f.txt 2>/dev/null; done
