#!/bin/bash
# Session 21's device calls (each one `run` call, <= 9.5 min, a short table last; raw files under $OUT):
#   A  compiled tests of the kernels changed since their last GPU run (the per-sequence ragged scan,
#      the joint span passes, the flat checkpoint / restore rows, the chain kernel's two-stage
#      default) (~3 min); the ragged scan A/B at a 0.8B GDN layer's step shapes
#      (benchmarks/ragged_scan.py, ~1 min); the step variants at rag's shape (plain, span, warm/0,
#      warm/4) with today's GDN passes and session 20's (span_step_work --time --forms new old,
#      ~2.5 min); rag at 16 seats, pic_off and fcfs in one process (issue 29's >= 1.0x,
#      composition share) (~2.5 min)
#   B  (carry .dev1/fixed_before.tgz: `mkdir -p .dev1 && git archive -o .dev1/fixed_before.tgz
#      82b4d81`, .dev1 is ignored, so name it in the call's carry) issue 29's span request with the
#      allocator preallocated (reordered goal 0.2x; first-call gap), then the plain hybrid step at
#      64 seats before (82b4d81) / after (flat checkpoint and restore rows)
#   E  (session 22: the budget for one call only) the compiled tests of the new kernels, B's
#      span request, rag at 16 seats, then the step forms (plain, warm/0; new / f32_qk: the
#      packed stream's q / k in float32 as before session 22 / old: session 20's passes), each
#      part within TOTAL (default 560 s)
# usage: OUT=$OUT [TOTAL=seconds, E only] bash benchmarks/history/scripts/s21_device.sh A|B|E
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc_s21
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s21_$1.txt
left() { echo $((${1:-560} - SECONDS + T0)); }
nvidia-smi -L > "$R" 2>/dev/null
RAG="-m benchmarks.cli rag --model qwen3_5_0_8b --dtype bfloat16 --num-requests 24
  --passage-tokens 128 --max-num-batched-tokens 1024 --min-token-bucket 1024 --max-num-seqs 16
  --max-model-len 4096 --num-kv-blocks 4096 --workloads multi zipf --modes offline --max-tokens 8"
case "$1" in
A)
  MINIPIC_COMPILED=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
    tests/test_gated_delta_seq_scan.py tests/test_span_joint_pass.py tests/test_span_joint_layer.py \
    tests/test_gated_delta.py tests/test_gated_delta_stream_dtype.py \
    tests/test_hybrid_checkpoint_rows.py \
    tests/test_hybrid_restore_rows.py tests/test_engine_hybrid_span_start.py \
    tests/test_engine_hybrid_barrier.py tests/test_chain_compose_kernel.py tests/test_span_maps.py \
    tests/test_engine_gdn_kernel.py > "$OUT/tests.txt" 2>&1
  echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
  grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
  timeout 120 python3 -m benchmarks.ragged_scan --reps 15 --json "$OUT/ragged_scan.json" \
    > "$OUT/ragged_scan.txt" 2>&1
  echo "ragged scan rc=$? t=$((SECONDS-T0)) s" >> "$R"; grep "^ragged scan" "$OUT/ragged_scan.txt" >> "$R"
  timeout 180 python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 --reps 9 \
    --variants plain warm/0 warm/4 --forms new f32_qk old > "$OUT/step_forms.txt" 2>&1
  echo "step forms rc=$? t=$((SECONDS-T0)) s" >> "$R"; grep "^time" "$OUT/step_forms.txt" >> "$R"
  L=$(left 575); [ "$L" -lt 60 ] && L=60
  timeout $L python3 $RAG --configs pic_off fcfs --compose-cost 1 --out "$OUT/rag" \
    > "$OUT/rag.txt" 2>&1
  echo "rag rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "requests/s|compose (cost|form triton|bf16_x6)|speed-up|^ *(multi|zipf)" "$OUT/rag.txt" \
    | cut -c1-240 >> "$R"
;;
B)
  XLA_PYTHON_CLIENT_PREALLOCATE=true timeout 200 python3 -m benchmarks.cli hybrid-spans --steps \
    --sync-repeat --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
  echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
  grep -E "^(call|[a-i] )|goal|warm-up" "$OUT/hybrid_spans.txt" | grep -v "^W1" | cut -c1-200 >> "$R"
  mkdir -p /tmp/kbefore && tar -xzf .dev1/fixed_before.tgz -C /tmp/kbefore
  L=$(left ${TOTAL:-560}); EACH=$(( (L - 10) / 2 ))
  for tree in before after; do
    dir=$PWD; [ $tree = before ] && dir=/tmp/kbefore
    (cd $dir && PYTHONPATH=$dir OUT=$OUT/fixed_$tree SEATS=64 LENS=25600 LIMIT=$EACH \
      bash benchmarks/runs/fixed_step_device.sh > /dev/null 2>&1)
    echo "fixed step $tree t=$((SECONDS-T0)) s" >> "$R"
    grep "ms/step\|rc=[^0]" "$OUT/fixed_$tree/fixed_step.txt" | cut -c1-200 >> "$R"
  done;;
E)
  L=$(left ${TOTAL:-560}); [ "$L" -gt 150 ] && L=150
  MINIPIC_COMPILED=1 timeout $L python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE -n 8 \
    tests/test_gated_delta_seq_scan.py tests/test_span_joint_pass.py tests/test_span_joint_layer.py \
    tests/test_engine_gdn_kernel.py tests/test_gated_delta_stream_dtype.py \
    tests/test_hybrid_checkpoint_rows.py tests/test_hybrid_restore_rows.py > "$OUT/tests.txt" 2>&1
  echo "compiled tests rc=$? t=$((SECONDS-T0)) s: $(tail -1 "$OUT/tests.txt")" >> "$R"
  grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-220 >> "$R"
  L=$(left ${TOTAL:-560}); [ "$L" -gt 220 ] && L=220
  if [ "$L" -ge 60 ]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=true timeout $L python3 -m benchmarks.cli hybrid-spans \
      --steps --sync-repeat --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
    echo "hybrid-spans rc=$? t=$((SECONDS-T0)) s" >> "$R"
    grep -E "^(call|[a-i] )|goal|warm-up" "$OUT/hybrid_spans.txt" | grep -v "^W1" \
      | cut -c1-200 >> "$R"
  fi
  L=$(left ${TOTAL:-560})
  if [ "$L" -ge 90 ]; then
    timeout $L python3 $RAG --configs pic_off fcfs --compose-cost 1 --out "$OUT/rag" \
      > "$OUT/rag.txt" 2>&1
    echo "rag rc=$? t=$((SECONDS-T0)) s" >> "$R"
    grep -E "requests/s|compose (cost|form triton|bf16_x6)|speed-up|^ *(multi|zipf)" \
      "$OUT/rag.txt" | cut -c1-240 >> "$R"
  fi
  L=$(left ${TOTAL:-560})
  if [ "$L" -gt 70 ]; then
    timeout $((L - 5)) python3 -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16 \
      --reps 7 --variants plain warm/0 --forms new f32_qk old > "$OUT/step_forms.txt" 2>&1
    echo "step forms rc=$? t=$((SECONDS-T0)) s" >> "$R"; grep "^time" "$OUT/step_forms.txt" >> "$R"
  fi;;
*) echo "usage: $0 A|B|E"; exit 2;;
esac
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
