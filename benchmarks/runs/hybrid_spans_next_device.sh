#!/bin/bash
# Next session (issue 19): after b50c9a6 (per-step hoisting of the hybrid step index/packing work), the same call as
# run 3 (benchmarks/history/gated_delta.md): compiled span-pass tests, rag fcfs then pic_off on qwen3_5_0_8b, compose cost. ~150 s.
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; T0=$SECONDS; rm -rf /tmp/rag_fcfs /tmp/rag_pic_off; MINIPIC_COMPILED=1 JAX_PLATFORMS=cuda timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_gated_delta_span_passes.py -k pallas 2>&1 | tail -2 | tee $OUT/compiled_tests.txt; LIMITS="90 0 118" bash benchmarks/runs/i19_device_s9.sh; python3 -c "
import json
for c in ('fcfs', 'pic_off'):
  try: d = json.load(open(f'/tmp/rag_{c}/rag_bench.json'))['results'][0]
  except Exception as e: print(c, 'no result', e); continue
  for r in d.get('runs', []): print(f\"{c:8s} {r['workload']:5s} {r['requests_per_second']:6.2f} req/s  hit {r['prefix_cache_hit_rate']:.3f}  computed {r['computed_prompt_tokens_per_second']*r['elapsed_time']:7.0f}  steps {r['steps']:3d}  ms/step {1e3*r['elapsed_time']/r['steps']:6.2f}  TPOT p50 {r['median_tpot_ms']:6.2f}  TTFT p50 {r['median_ttft_ms']:7.1f}\")
  cc = d.get('compose_cost')
  if cc and 'step_ms' in cc: print(f\"compose: step {cc['step_ms']:.2f} ms, composition {cc['compose_ms']:.3f} ms = {cc['compose_share']:.2%}, per span {cc['per_span_ms']:.3f} ms = {cc['per_span_share']:.3%}, synthetic {cc['synthetic_compose_ms']}\")
" | tee $OUT/table.txt; echo "total $((SECONDS-T0)) s"
