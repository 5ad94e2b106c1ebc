#!/bin/bash
# Session 9 (helper s9-ttft): the cached-span TTFT with the compiled step op counts and the decode-part A/B (~150-200 s).
# Run from the repository root with PYTHONPATH=$PWD, JAX_COMPILATION_CACHE_DIR set.
# issue 14, cached-span step (branch s9-ttft). Expected wall ~150-200 s (8B random bf16 load ~7 s,
# warm-up of 18 step variants cold ~120 s, cold + 3 cached requests ~3 s, replay/profile A/B ~20 s).
python3 -m benchmarks.cli rag --configs ttft --workloads multi --modes offline --num-requests 8 --ttft-repeats 3 --ttft-profile 1 --out $OUT > $OUT/rag_ttft.log 2>&1; tail -30 $OUT/rag_ttft.log; python3 - <<'PY'
import json, os
r = [x for x in json.load(open(os.environ["OUT"] + "/rag_bench.json"))["results"] if x.get("config") == "ttft"][0]
p = r.get("cached_step_profile") or {}
print(f"cold {r['cold_ttft_ms']:.1f} ms  cached {r['cached_ttft_ms']:.1f} ms  step {r['cached_step_ms']:.1f} ms  ratio {r['cold_over_cached']:.1f}x  warm-up {r['warmup_s']:.0f} s")
print(f"{'variant':18s} {'alone ms':>8s} {'busy ms':>8s} {'kernels':>8s}  compiled ops")
for label, q in (("planned", p), ("with decode part", p.get("with_decode_part"))):
    if q: print(f"{label:18s} {q['step_alone_ms']:8.2f} {q['kernel_busy_ms_per_step']:8.2f} {q['kernels_per_step']:8.0f}  {q['hlo_ops']}")
PY
