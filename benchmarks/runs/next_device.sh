#!/bin/bash
# The next device session's calls (each one `run` call, <= 9.5 min; each prints a short table last; raw
# files under $OUT). Session 21 had no device (lending paused); its calls are in s21_device.sh:
#   1. OUT=$OUT bash benchmarks/history/scripts/s21_device.sh A: compiled tests of the per-sequence ragged scan,
#      the joint span passes, the flat checkpoint / restore rows and the chain kernel's default;
#      the ragged scan A/B; the step variants new vs old forms; rag at 16 seats (pic_off + fcfs)
#   2. s21_device.sh B (carry .dev1/fixed_before.tgz = git archive 82b4d81): the span request with
#      the allocator preallocated (reordered goal 0.2x), the plain step at 64 seats before/after
#   3. on an H200 when one comes: D (issue 28's TTFT, goal 100x), X again (no remat), F, rag 16 seats
# Session 20 ran Y, X, spanstep `after`, F, the ttft script, compose_sweep_device.sh and
# final20_device.sh on an H100 (benchmarks/RESULTS.md); K below is folded into s21_device.sh.
# (The device's `git log` line prints a stale commit: its .git is not refreshed; name the commit here.)
#   T  the compiled kernel tests of every kernel changed since its last GPU run (~2.5 min): the chain
#      kernel's bf16 presets: fixed in d2247e8, passed on the H100 in session 19
#   A  T + issue 27's decode before/after (2 rounds alternating; carry .dev1/before.tgz = git archive
#      8e11161) + issue 29's composition cost if time is left
#   B  issue 27's RAG before/after (rotated vs fcfs, 40 requests; carry .dev1/before.tgz)
#   C  issue 28: the paged-keys sweep (compiled tests first) + the exact XLA limit at 40,960 (XLA_LIMIT=exact)
#   X  issue 28: the exact XLA limit (Config.compilation.xla_memory_limit="exact", session 19) on the
#      ttft engine at max_model_len 40,960 then 33,792 (the one that warned 9 times): goal 0 warnings and
#      no "Peak memory ... cut" in the VLOG, and the first calls run (no OOM); then make "exact" the default
#   D  issue 28: TTFT through LLM.generate (today's host path and resident tables), then issue 29's span
#      request (hybrid_spans) if time is left
#   E  issue 29: the GDN Mosaic kernels and the engine A/B (carry .whl: fla_core, einops)
#   F  issue 29: the hybrid span request alone (`minipic-bench hybrid-spans`, default options: its
#      warm-up of ~27 variants may not fit D's remainder), LIMIT 540
#   G  (H100) issue 27 again after A/B failed there: the decode before/after at --batch 64 (128 ran out
#      of memory in both trees) and the RAG before/after (the archive lacked the data file)
#   H  issue 29: the composition cost alone (A's tail; it did not get time in session 19)
#   W  (carry .dev1/lower_before.tgz = git archive 6241c40) session 19's per-kernel jits (write_kv, GDN
#      prefill: traced/lowered once per variant) and pipelined compiles: compiled tests of the wrapped
#      paths, then the decode warm-up + step before/after (the program must be the same)
#   S  (carry .dev1/lower_before.tgz) issue 29 goal 1: rag fcfs at 16 seats before/after session 19's span
#      step cuts (s19-spanstep), ~8 min; P the pic_off anchor (~4 min)
#   V  (carry .dev1/warm_before.tgz = git archive of this tree with s19-warm's two cuts reverted:
#      branch s19-warm-before, `git revert 2cdee85 6abba05` on 8434314) issue 29: GPU ms per step of span, warm/0,
#      warm/4 at rag's shape before/after s19-warm's cuts (2 alternating rounds, ~6-8 min)
#   Y  (session 20: W with T's whole compiled set) T + the engine's GDN kernel, step lowering, span maps and
#      the Qwen3.5 span step compiled (s19-warm's ragged.py/affine.py cuts), then W's warm-up before/after
#   L  the engine bench's fill fix (585ecae) at batch 128 on the H100: memory by stage, then the decode bench
# usage: OUT=$OUT bash benchmarks/runs/next_device.sh A
set -u; T0=$SECONDS; export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
left() { echo $((${1} - SECONDS + T0)); }
compiled_tests() {
  MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD timeout ${TLIMIT:-200} \
    python3 -m pytest -q -o addopts= -p no:cacheprovider -n 8 -rfE tests/test_paged_attention*.py \
    tests/test_gated_delta*.py tests/test_chain_compose_kernel.py tests/test_kernel_registry.py \
    tests/test_kernel_entry_points.py tests/test_block_table_array.py ${EXTRA:-} > "$OUT/compiled_tests.txt" 2>&1
  echo "compiled tests rc=$? t=$((SECONDS-T0)) s"
  grep -E "^(FAILED|ERROR) " "$OUT/compiled_tests.txt" | cut -c1-200 | head -20; tail -1 "$OUT/compiled_tests.txt"
}
case "${1:-T}" in
T) compiled_tests;;
A) compiled_tests
   ROUNDS=2 BEFORE_TGZ=.dev1/before.tgz bash benchmarks/runs/issue27_next_device.sh engine 2>&1 \
     | grep -v "^W1\|bfc_allocator\|^If this\|^Current alloc" | tail -24
   L=$(left 570); [ "$L" -gt 200 ] && RAG_LIMIT=$((L - 140)) bash benchmarks/runs/compose_next_device.sh 2>&1 | tail -30;;
B) BEFORE_TGZ=.dev1/before.tgz bash benchmarks/runs/issue27_next_device.sh rag 2>&1 | tail -30;;
C) bash benchmarks/runs/kernel_prefill_paged_next_device.sh 2>&1 | tail -40
   L=$(left 570); [ "$L" -gt 150 ] && XLA_LIMIT=exact LIMIT=$((L - 20)) bash benchmarks/runs/pool_reserve_next_device.sh 2>&1 | tail -30;;
S) BEFORE_TGZ=.dev1/lower_before.tgz bash benchmarks/runs/spanstep_next_device.sh fcfs 2>&1 | tail -24;;
P) bash benchmarks/runs/spanstep_next_device.sh pic_off 2>&1 | tail -16;;
V) mkdir -p /tmp/wbefore && tar -xzf .dev1/warm_before.tgz -C /tmp/wbefore
   for r in 1 2; do
     (cd /tmp/wbefore && ROUNDS=1 OUT=$OUT/warm_before_$r bash benchmarks/runs/warm_step_device.sh 2>&1 | tail -5)
     ROUNDS=1 OUT=$OUT/warm_after_$r bash benchmarks/runs/warm_step_device.sh 2>&1 | tail -5
   done;;
W) BEFORE_TGZ=.dev1/lower_before.tgz bash benchmarks/runs/lower_next_device.sh 2>&1 | tail -30;;
K) EXTRA="tests/test_hybrid_checkpoint_rows.py tests/test_hybrid_restore_rows.py tests/test_engine_hybrid_span_start.py tests/test_engine_hybrid_barrier.py" TLIMIT=220 compiled_tests
   mkdir -p /tmp/kbefore && tar -xzf .dev1/fixed_before.tgz -C /tmp/kbefore
   (cd /tmp/kbefore && OUT=$OUT/fixed_before LIMIT=90 bash benchmarks/runs/fixed_step_device.sh 2>&1 | tail -6)
   OUT=$OUT/fixed_after LIMIT=90 bash benchmarks/runs/fixed_step_device.sh 2>&1 | tail -6;;
Y) EXTRA="tests/test_engine_gdn_kernel.py tests/test_step_lowering.py tests/test_span_maps.py tests/test_qwen3_5_spans.py" \
     TLIMIT=230 compiled_tests
   SKIP_TESTS=1 LIMIT=130 BEFORE_TGZ=.dev1/lower_before.tgz bash benchmarks/runs/lower_next_device.sh 2>&1 | tail -12;;
L) bash benchmarks/runs/live_bytes_next_device.sh 2>&1 | tail -30;;
X) TAG=_exact_40960 XLA_LIMIT=exact LIMIT=250 bash benchmarks/runs/pool_reserve_next_device.sh 2>&1 | tail -24
   L=$(left 570); [ "$L" -gt 150 ] && TAG=_exact_33792 MAX_LEN=33792 XLA_LIMIT=exact LIMIT=$((L - 20)) \
     bash benchmarks/runs/pool_reserve_next_device.sh 2>&1 | tail -24;;
D) LIMIT_XLA=200 LIMIT_ON=1 bash benchmarks/runs/ttft_next_device.sh 2>&1 | tail -30
   L=$(left 570); [ "$L" -gt 160 ] && bash benchmarks/runs/hybrid_spans_next_device.sh 2>&1 | tail -20;;
E) bash benchmarks/runs/gdn_mosaic_next_device.sh 2>&1 | tail -30
   bash benchmarks/runs/gdn_mosaic_engine_next_device.sh 2>&1 | tail -20;;
G) BATCH=64 ROUNDS=2 BEFORE_TGZ=.dev1/before.tgz bash benchmarks/runs/issue27_next_device.sh engine 2>&1 | tail -16
   BEFORE_TGZ=.dev1/before.tgz bash benchmarks/runs/issue27_next_device.sh rag 2>&1 | grep -v "^W1" | tail -12;;
H) RAG_LIMIT=400 bash benchmarks/runs/compose_next_device.sh 2>&1 | tail -30;;
F) LIMIT=540 bash benchmarks/runs/hybrid_spans_next_device.sh 2>&1 | tail -30;;
*) echo "usage: $0 K|Y|T|A|B|C|D|E|F|G|H|X|L|W|S|P|V"; exit 2;;
esac
echo "== total t=$((SECONDS-T0)) s"
