#!/bin/bash
# Ran at 6e181d2 (the scan-with-output was reverted after this run: 1.42-1.92x fla, RESULTS.md
# "Gated DeltaNet"); check that commit out to rerun it.
# Session 39: the gated delta rule's output computed in the state scan (`fused_gated_delta
# output="scan"`: no per-chunk states or V' written, no output kernel) against the Mosaic
# output kernel and fla at 32K tokens of one Qwen3.5-0.8B layer (issue 29's GDN goal: <= 0.8x
# fla), with its launch options; first the compiled gated-delta tests (the new kernel path
# checked against the float64 recurrence on the GPU). Carry .whl (fla-core 0.6.0, einops) or
# name another folder of those wheels in WHL.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s39c_gdn_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s39c.txt
left() { echo $((${TOTAL:-540} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout ${TESTS_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 4 \
  tests/test_gated_delta.py tests/test_gated_delta_decay_precision.py > "$OUT/tests.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
  ${WHL:-.whl}/fla_core*.whl ${WHL:-.whl}/einops*.whl > /dev/null 2>&1
V="fused_mosaic_out fused_mosaic_scan_out fused_mosaic_scan_out_bv32 fused_mosaic_scan_out_w8"
V="$V fused_mosaic_scan_out_s2 fused_mosaic_scan_out_kv fused_mosaic_scan_out_bv32_w8"
V="$V fused_scan_out"
PYTHONPATH=$PWD:/tmp/site timeout $(left) python3 -m benchmarks.cli gdn --tokens 32768 \
  --reps 5 --variants $V --profile > "$OUT/gdn.txt" 2>&1
echo "gdn rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -v "^W1" "$OUT/gdn.txt" | grep -E "fla|fused|busy|solve" | tail -30 | cut -c1-220 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
