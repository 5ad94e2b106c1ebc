#!/bin/bash
# Next H100/H200 call, issue 28 item 2 (the cached-span step without the key pre-pass): the
# paged-keys variants (mosaic_prefill_paged.PagedOptions) swept against dv+idle in one call.
# Call 2 (2026-12-05, H100, /work/notes/dev17/call2): the first version (pk:v1 here) was 1.41x
# slower than dv+idle: its kernel 0.204 ms vs 0.101 + 0.051 gather, plus 0.042 ms of
# loop_concatenate_fusion (the 8-copy shifted cos | sin table, 69 MB, built every call).
# 1. The paged-keys kernel's compiled tests (every option's case; the 16-bit case is the
#    sweep's pk:packed), under a short timeout, with ptxas's report: a timeout here may be a
#    compiled-only fault (a barrier count or order).
# 2. The sweep: the cached-span attention call (72 rows over 8 x 4096 position-free cached keys,
#    Llama-3.1-8B heads), each variant's ptxas registers / spills printed after its
#    "compiling" line, profile per kernel (busy = union of kernels; rest = XLA glue), ABBA wall
#    time against dv+idle, error against dv+idle's output (about 4e-3 between two correct
#    kernels; pk:norot reads the keys unrotated, its error is meaningless).
# Variants (benchmarks/cached_span_attention.py PAGED; predictions in the s17-pagedk report):
# pk:v1 the first version; pk:keys its cos | sin per key; pk:vfirst values before the keys'
# wait; pk:pf1 / pk:pf2 keys first + L2 prefetch 1 / 2 steps ahead (pk:pf1 = the defaults);
# pk:vf_pf1 both; pk:rot / pk:rot200 / pk:rot_pk a fourth warpgroup rotates (registers
# 208/24/72, 200/40/72; rot_pk in bf16x2); pk:packed bf16x2 rotation; pk:r200 registers 200/112;
# pk:norot no rotation (timing only). The last ones are cut first if the sweep runs long.
# ALSO_OTHERS=1 also runs the other compiled prefill/mixed tests (~2 min more).
#   bash benchmarks/runs/kernel_prefill_paged_next_device.sh        # ~5 min (at most 6)
set -u
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=/tmp/jcc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -o addopts= -p no:cacheprovider"
# ptxas's report lines, without the missing nvdisasm's noise
ptxas_lines() { grep -i "^compiling \|used [0-9]* registers\|bytes spill" "$1" \
  | sed 's/^.*\(Used [0-9]* registers\).*$/  \1/; s/^ *\([0-9]* bytes stack.*\)$/  \1/'; }
MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda MOSAIC_GPU_DUMP_PTXAS=1 \
  timeout 110 $PYTEST -s tests/test_paged_attention_paged_keys.py tests/test_paged_attention_paged_rotator.py \
  -k "match_reference or options_match or (rotated_mode and one-step) or rotating" \
  > "$OUT/paged_keys_tests.txt" 2>&1
rc=$?
tail -3 "$OUT/paged_keys_tests.txt"
echo "ptxas over the tests' kernels (count, line):"
grep -hoi "used [0-9]* registers\|[0-9]* bytes spill [a-z]*" "$OUT/paged_keys_tests.txt" \
  | sort | uniq -c | head -20
# (a timeout may be a compiled hang or just slow compiles: the sweep runs anyway, under its own
# timeout, printing each variant's row as it is measured)
if [ "$rc" = 124 ]; then echo "paged-keys tests TIMED OUT (compiled hang? see which test)"; fi
if [ "${ALSO_OTHERS:-0}" = 1 ]; then
  MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 150 $PYTEST \
    tests/test_paged_attention_mixed.py tests/test_paged_attention_mgpu_prefill.py \
    > "$OUT/compiled_tests.txt" 2>&1
  tail -3 "$OUT/compiled_tests.txt"
fi
# most telling first: a sweep cut by the timeout keeps the rows (and A/B lines) measured so far
VARIANTS=dv+idle,pk:v1,pk:pf1,pk:rot,pk:keys,pk:norot,pk:vfirst,pk:packed,pk:rot200,pk:rot_pk
VARIANTS=$VARIANTS,pk:vf_pf1,pk:pf2,pk:r200
mkdir -p "$OUT/ptxas_sweep"
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptxas_sweep" \
  timeout 240 python3 -m benchmarks.cached_span_attention \
  --variants "$VARIANTS" --out "$OUT/cached_span_paged_sweep.json" \
  > "$OUT/cached_span_paged_sweep.log" 2>&1
echo "sweep rc=$?"
grep -v "nvdisasm\|Source Location\|dump.cc\|^===\|^\s*$" "$OUT/cached_span_paged_sweep.log" \
  | grep -iv "ptxas\|registers\|spill\|stack frame\|^compiling \|warning" \
  > "$OUT/cached_span_paged_sweep.txt"
cat "$OUT/cached_span_paged_sweep.txt"
echo "ptxas per variant (launch registers; spills: the kernel's):"
ptxas_lines "$OUT/cached_span_paged_sweep.log"
# (a build that writes the report to MOSAIC_GPU_DUMP_TO instead: its files in compile order)
for f in $(ls -tr "$OUT/ptxas_sweep"); do
  grep -qi "registers" "$OUT/ptxas_sweep/$f" && { echo "$f"; ptxas_lines "$OUT/ptxas_sweep/$f"; }
done
