#!/bin/bash
# Session 38's second call: the row kernels tuned (s38's first call: as built they made the hybrid
# decode step slower, 1.80 -> 2.76 ms, each kernel 14-24 us where XLA's GEMM takes 4-9; session
# 37's per-call bench timed only the ~31 us dispatch). One `run`, <= 9.5 min, any card:
# 1. compiled tests of the row kernels' launch options (split-K, stages);
# 2. every launch option of each kernel at Qwen3.5-0.8B's widths, 8 rows, timed as a chain of a
#    call a layer over every layer's weights (benchmarks/row_matmul_bench.py --sweep), the best
#    three profiled; the best over each kernel's parts written to best.json;
# 3. the hybrid decode step (t = 8, s = 8, 64 seats) with those options: today, both row
#    switches, both + the decode kernel reading a / b / z in the projection (DECODE_GATES_IN_PROJ),
#    today again (the replays spread +-0.2 ms);
# 4. the MLP chain at 8 / 16 rows, both models, with the best options.
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s38b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s38b.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
MINIPIC_COMPILED=1 timeout 45 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_row_matmul.py -k "launch_option or decode_step_with" \
  > "$OUT/tests_s38b.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s38b.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s38b.txt" | cut -c1-200 | sort -u | head -6 >> "$R"
L=$(left); L=$((L - 130)); [ "$L" -gt 220 ] && L=220
timeout $L python3 -m benchmarks.row_matmul_bench --sweep --models qwen3_5_0_8b --rows 8 \
  --best-out "$OUT/best.json" > "$OUT/sweep.txt" 2>&1
echo "sweep rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep "^==" "$OUT/sweep.txt" | cut -c1-200 >> "$R"
OPT=""; [ -s "$OUT/best.json" ] && OPT="--row-options $OUT/best.json"
ROWS=MLP_ROW_KERNEL=1,MIXER_ROW_KERNELS=1
L=$(left); L=$((L - 25)); [ "$L" -gt 170 ] && L=170
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 --ckpt 1 --decode --reps 15 --profile 8 $OPT \
  --forms "" $ROWS $ROWS,DECODE_GATES_IN_PROJ=1 "" \
  > "$OUT/decode_ab.txt" 2>&1
echo "decode A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^row_matmul|^live|^time.*decode|^profile decode" \
  "$OUT/decode_ab.txt" | grep -v "prefill" \
  | sed "s/time qwen3_5_0_8b seats=64 max_model_len=25600 caching=1 small_seq_bucket=8 fuse=1//" \
  | cut -c1-200 >> "$R"
L=$(left); [ "$L" -gt 60 ] && L=60
if [ "$L" -ge 25 ] && [ -s "$OUT/best.json" ]; then
  timeout $L python3 - "$OUT/best.json" > "$OUT/mlp_chain.txt" 2>&1 <<'EOF'
import json, sys
from kernels_pallas.row_matmul import api
for kernel, option in json.load(open(sys.argv[1])).items():
    api.OPTIONS[kernel] = api.OPTIONS[kernel] | option
from benchmarks import row_matmul_bench
row_matmul_bench.main(["--rows", "8", "16"])
EOF
  echo "mlp chain rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep "mlp rows" "$OUT/mlp_chain.txt" | cut -c1-200 >> "$R"
fi
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
