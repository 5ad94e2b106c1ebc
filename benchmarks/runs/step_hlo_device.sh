#!/bin/bash
# The optimized HLO of the plain prefill step of one request at 64 seats (fixed_step_work's
# engine, token bucket TOKENS), compiled fresh with XLA's dump on: its copies, transposes and
# concatenations (the fusions a profile names) to $OUT/hlo_copies.txt, the module itself to
# $OUT; prints a count line. DECODE=1: the decode step too; every step module's kernels by
# named scope (benchmarks/hlo_kernels.py) to $OUT/hlo_kernels.txt.
# usage: OUT=$OUT [TOKENS=128] [DECODE=1] [LIMIT=90] bash benchmarks/runs/step_hlo_device.sh >> t
set -u; T0=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; D=/tmp/dump_step_hlo; rm -rf $D
XLA_FLAGS="--xla_dump_to=$D --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step_impl.*" \
  JAX_COMPILATION_CACHE_DIR=/tmp/jcc_step_hlo timeout ${LIMIT:-90} python3 -m \
  benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600 --tokens ${TOKENS:-128} \
  --reps 2 --ckpt 1 $([ "${DECODE:-0}" = 1 ] && echo --decode) > "$OUT/dump_run.txt" 2>&1
echo "hlo dump rc=$? t=$((SECONDS-T0)) s: $(ls $D | wc -l) files"
for f in $(ls -S $D/*after_optimizations.txt 2>/dev/null | head -2); do
  echo "== $(basename $f) $(wc -c < $f) bytes" >> "$OUT/hlo_copies.txt"
  grep -E "^\s*(ROOT )?%?(copy|[a-z_]*transpose_fusion|[a-z_]*concatenate_fusion)[.0-9_]* = " $f \
    | grep -vE "= (s32|pred|u32)\[[0-9,]{0,12}\]" | cut -c1-400 >> "$OUT/hlo_copies.txt"
  cp $f "$OUT/" 2>/dev/null
done
echo "copies: $(grep -c " copy(" "$OUT/hlo_copies.txt" 2>/dev/null)"
for f in $D/*step_impl*after_optimizations.txt; do
  [ -f "$f" ] || continue
  echo "== $(basename $f)" >> "$OUT/hlo_kernels.txt"
  python3 -m benchmarks.hlo_kernels "$f" --top 25 >> "$OUT/hlo_kernels.txt" 2>&1
done
