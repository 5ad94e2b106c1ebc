#!/bin/bash
# Session 10, device call D (H200, ~300 s): GDN segment-sum decays (compiled tests, bf16 speed vs fla and vs 2154e46), then the hybrid span step (compiled skip test, rag fcfs vs pic_off).
T00=$SECONDS
(
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc XLA_PYTHON_CLIENT_PREALLOCATE=false; R=$PWD
python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$R:/tmp/site
T="python3 -m pytest -v -rfE -p no:cacheprovider -o addopts="
(MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 75 $T -n 4 tests/test_gated_delta.py tests/test_gated_delta_affine.py tests/test_gated_delta_decay_precision.py > $OUT/gdn_tests.txt 2>&1) &
(MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 75 $T -n 3 --run-slow tests/test_qwen3_5.py -k "float64_truth or logits_and_greedy or pallas_gdn_path" > $OUT/qwen_tests.txt 2>&1) &
wait
B="python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 --variants fused"
timeout 35 $B > $OUT/bench_new.txt 2>&1
mkdir -p /tmp/old && git archive 2154e46 kernels_pallas 2>/dev/null | tar -x -C /tmp/old && (cd /tmp/old && PYTHONPATH=/tmp/old:$PYTHONPATH timeout 25 $B --no-fla > $OUT/bench_old.txt 2>&1)
echo "== summary (before, 2154e46: fused 1.337 ms vs fla 1.249 ms = 1.07x)"
for f in gdn_tests qwen_tests; do echo "$f: $(grep -E '^=+ .*(passed|failed).* =+$' $OUT/$f.txt | tail -1)"; grep -E '^(FAILED|ERROR) ' $OUT/$f.txt; done
grep -hE "^E +(AssertionError|Max abs|Mismatch)|off the float64" $OUT/*_tests.txt | head -6
for f in bench_new bench_old; do echo "-- $f"; grep -E "^ +32768 " $OUT/$f.txt 2>/dev/null || tail -2 $OUT/$f.txt 2>/dev/null; done
) 2>&1 | tail -22; echo "gdn part t=$((SECONDS-T00))"
(
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; T0=$SECONDS; rm -rf /tmp/rag_fcfs /tmp/rag_pic_off; MINIPIC_COMPILED=1 timeout 28 python3 -m pytest -q -p no:cacheprovider tests/test_gated_delta_span_passes.py -k pallas 2>&1 | tail -2 | tee $OUT/compiled_tests.txt; LIMITS="90 0 118" bash benchmarks/runs/i19_device_s9.sh; python3 benchmarks/runs/rag_table.py | tee $OUT/table.txt; echo "total $((SECONDS-T0)) s"
) 2>&1 | tail -14
