#!/bin/bash
# The row kernels' first device call (built in session 37, whose later starts all failed: the
# next session's first call; one `run`, <= 9.5 min, a short table last; any card): a decode
# step's MLP in two kernels and the mixers' norms / output projections in them
# (kernels_pallas/row_matmul; layers.MLP_ROW_KERNEL, MIXER_ROW_KERNELS, off until this):
# 1. compiled tests (MINIPIC_COMPILED=1 tests/test_row_matmul.py);
# 2. the hybrid decode step (t = 8, s = 8, 64 seats) today, with both row-kernel switches
#    (layers.MLP_ROW_KERNEL and MIXER_ROW_KERNELS: the mixers' norms in their projections, their
#    output projections with the residual) and with the MLP's only, every kernel of each (where
#    its ~380 kernels go);
# 3. the MLP alone, kernels vs XLA, A/B interleaved (benchmarks/row_matmul_bench.py: the
#    defaults at 8 / 16 / 64 rows of both shapes, then each kernel alone at every block and warp
#    option, Qwen3.5-0.8B's widths and 8 rows: `--parts`, the best three of each);
# 4. with the time left, rag at 16 seats with session 37's defaults, twice (zipf's 1.0x goal).
# First, 10 s: the reordered span request's admission on this host's CPU (benchmarks.
# span_admission_host).
# usage: OUT=$OUT [TOTAL=seconds] bash benchmarks/runs/s37c_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s37c.txt
left() { echo $((${TOTAL:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
# the reordered hybrid span request's admission on this host's CPU, device stubbed (s36b timed it
# at 4.20 ms in the engine on such a host, 0.84 ms on the CPU VM): this host's Python, or the
# engine's run?
JAX_PLATFORMS=cpu timeout 60 python3 -m benchmarks.span_admission_host --parts \
  > "$OUT/admission_host.txt" 2>&1
echo "admission (host, stubbed) rc=$? t=$((SECONDS-T0)) s" >> "$R"
tail -7 "$OUT/admission_host.txt" | cut -c1-120 >> "$R"
MINIPIC_COMPILED=1 timeout 80 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE \
  tests/test_row_matmul.py > "$OUT/tests_s37c.txt" 2>&1
echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests_s37c.txt" | cut -c1-120)" >> "$R"
grep -E "^(FAILED|ERROR) |^E  " "$OUT/tests_s37c.txt" | cut -c1-200 | sort -u | head -8 >> "$R"
L=$(left); L=$((L - 60)); [ "$L" -gt 210 ] && L=210
[ "$L" -ge 60 ] && timeout $L python3 -m benchmarks.fixed_step_work --time --seats 64 \
  --max-model-len 25600 --tokens 128 --ckpt 1 --decode --reps 15 --profile 400 \
  --forms "" MLP_ROW_KERNEL=1,MIXER_ROW_KERNELS=1 MLP_ROW_KERNEL=1 > "$OUT/decode_ab.txt" 2>&1
echo "decode A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "^live|^time|^profile (decode|prefill) t=[0-9]+ s=[0-9]+:" "$OUT/decode_ab.txt" \
  | sed "s/time qwen3_5_0_8b seats=64 max_model_len=25600 caching=1 small_seq_bucket=8 fuse=1//" \
  | cut -c1-160 >> "$R"
L=$(left); [ "$L" -gt 70 ] && L=70
[ "$L" -ge 30 ] && timeout $L python3 -m benchmarks.row_matmul_bench --rows 8 16 64 \
  > "$OUT/mlp_ab.txt" 2>&1
echo "mlp A/B rc=$? t=$((SECONDS-T0)) s" >> "$R"
grep -E "rows" "$OUT/mlp_ab.txt" | cut -c1-170 >> "$R"
L=$(left); [ "$L" -gt 100 ] && L=100
[ "$L" -ge 40 ] && timeout $L python3 -m benchmarks.row_matmul_bench --shapes qwen3_5_0_8b \
  --rows 8 --parts > "$OUT/mlp_parts.txt" 2>&1
echo "mlp parts (each kernel's options) rc=$? t=$((SECONDS-T0)) s" >> "$R"
for k in norm_swiglu matmul_residual; do
  grep " $k " "$OUT/mlp_parts.txt" | sort -k15 -g | head -3 | cut -c1-150 >> "$R"
done
for i in 1 2; do
  L=$(left); L=$((L - 10)); [ "$L" -gt 100 ] && L=100
  [ "$L" -ge 60 ] && OUT=$OUT LIMIT=$L NAME=rag_$i COMPOSE=0 \
    bash benchmarks/runs/rag16_device.sh >> "$R"
done
echo "== total t=$((SECONDS-T0)) s" >> "$R"
# few files come back from a call: the JSONs in one archive
(cd "$OUT" && find . -name "*.json" | tar czf raw_json.tgz -T - && find . -name "*.json" -delete)
cat "$R"
