#!/bin/bash
# Issue 29 item 5, the Mosaic GPU kernels (intra_mosaic.py, output_mosaic.py) at the bf16 32K
# prefill of one Qwen3.5-0.8B GDN layer: their compiled tests (slow ones included); kernel 1 alone
# (Triton blocked vs Mosaic: block products in 3 / 1 passes, and lean = KD through K's tile,
# 69 KB SMEM, three CTAs per SM) with ptxas' registers / spills per kernel; then the whole
# prefill vs fla (fused = all Triton; fused_mosaic_out = Mosaic solve and output), every variant
# --profile'd: its kernels by part (solve / scan / output / glue) next to each part's floor at
# H100 rates (benchmarks/gdn_profile.py). <= 5 min; carry .whl (fla + einops wheels).
export PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jcc XLA_PYTHON_CLIENT_PREALLOCATE=false; R=$PWD
timeout 60 python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$R:/tmp/site
MINIPIC_COMPILED=1 MINIPIC_RUN_SLOW=1 JAX_PLATFORMS=cuda timeout 75 python3 -m pytest -v -rfE -p no:cacheprovider -o addopts= tests/test_gated_delta_mosaic.py > $OUT/mosaic_tests.txt 2>&1
B="python3 -m benchmarks.cli gdn --tokens 32768 --reps 5 --profile"
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/mdump timeout 90 $B --no-fla --variants intra_only_blocked intra_only_mosaic intra_only_mosaic_p1 intra_only_mosaic_lean intra_only_mosaic_lean_p1 > $OUT/bench_intra.txt 2>&1
grep -rhE "registers|spill|smem|Compiling entry" /tmp/mdump $OUT/bench_intra.txt 2>/dev/null | sort | uniq -c | head -40 > $OUT/ptxas.txt
timeout 120 $B --variants fused fused_mosaic_out fused_mosaic_out_lean > $OUT/bench_fused.txt 2>&1
echo "== expected: tests all passed; intra_only_mosaic_lean below intra_only_mosaic (H100 0.442 ms; floors memory 0.226 / tensor 0.139 ms); fused_mosaic_out_lean <= 0.8x fla (fused_mosaic_out was 0.88x)"
echo "mosaic_tests: $(grep -E '^=+ .*(passed|failed).* =+$' $OUT/mosaic_tests.txt | tail -1)"; grep -E '^(FAILED|ERROR) ' $OUT/mosaic_tests.txt
grep -hE "^E +(AssertionError|ValueError|Max abs|Mismatch)" $OUT/mosaic_tests.txt | head -4
for f in bench_intra bench_fused; do echo "-- $f"; grep -E "^ +32768 |^T=32768 .*profile" $OUT/$f.txt 2>/dev/null || tail -3 $OUT/$f.txt 2>/dev/null; done
echo "-- ptxas (per Mosaic kernel: registers, spills; 3 CTAs per SM need <= 168 registers)"; grep -iE "registers|spill" $OUT/ptxas.txt | head -8
