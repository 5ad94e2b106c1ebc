#!/bin/bash
# Why a decode step of the reordered span request takes ~2.2 ms in `hybrid-spans` (dispatch ~1 ms,
# read-back wait ~0.4 ms) when the same 0.8B decode step is 1.56 ms a token through
# LLM.generate in s40c_device.sh (session 41, H100). The engines differ in options: s40c's has
# max_model_len 1,024 and 256 KV blocks (XLA_PYTHON_CLIENT_PREALLOCATE=false), hybrid-spans' has
# max_model_len 25,600, 64 seats, 1,024 tokens a step and the default pool (all free memory,
# PREALLOCATE=true; XLA warns it cannot fit its step under the limit the pool leaves).
# Per setting, one process: ms a decode step = (t34 - t2) / 32 (median of 5, after an untimed
# pair) and the mean host ms of the step's dispatch (the compiled call) a decode step.
# usage: OUT=$OUT bash benchmarks/runs/s41b_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$OUT/s41b.txt
nvidia-smi -L > "$R" 2>/dev/null
BIG='"max_model_len": 25600, "max_num_seqs": 64, "max_num_batched_tokens": 1024'
while IFS='|' read -r name prealloc opts; do
  [ -z "$name" ] && continue
  XLA_PYTHON_CLIENT_PREALLOCATE=$prealloc timeout 150 python3 - "$name" "{$opts}" >> "$R" 2>&1 <<'PY'
import json, statistics, sys, time
import jax
from minipic_jax import LLM, SamplingParams
name, opts = sys.argv[1], json.loads(sys.argv[2])
import os
MODEL = os.environ.get("MODEL", "qwen3_5_0_8b")
DTYPE = "bfloat16" if jax.default_backend() == "gpu" else "float32"
t0 = time.perf_counter()
llm = LLM(MODEL, dtype=DTYPE, seed=0, warmup=False, **opts)
start = time.perf_counter() - t0
runner = llm.llm_engine.runner
spent = [0.0, 0]
inner = runner._dispatch
def dispatch(*a, **k):
    t = time.perf_counter()
    try:
        return inner(*a, **k)
    finally:
        spent[0] += time.perf_counter() - t; spent[1] += 1
runner._dispatch = dispatch
prompt = {"prompt_token_ids": list(range(1, 65))}
def timed(n):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter(); llm.generate([prompt], sp, use_tqdm=False)
    return time.perf_counter() - t
timed(2); timed(34)
per = []
for _ in range(5):
    spent[:] = [0.0, 0]; a = timed(2); d2 = spent[0]
    spent[:] = [0.0, 0]; b = timed(34); d34, n34 = spent[0], spent[1]
    per.append(((b - a) / 32 * 1e3, (d34 - d2) / 32 * 1e3))
step = statistics.median(p[0] for p in per); disp = statistics.median(p[1] for p in per)
print(f"{name}: {step:.3f} ms a decode step, dispatch {disp:.3f} ms (steps min {min(p[0] for p in per):.3f}; "
      f"blocks {llm.config.num_kv_blocks}; start {start:.1f} s; {jax.devices()[0].device_kind}; {opts})")
PY
  echo "  rc=$? t=$((SECONDS-T0)) s" >> "$R"
done <<CONFIGS
s40c|false|"max_model_len": 1024, "num_kv_blocks": 256
spans_engine|true|$BIG
spans_engine_noprealloc|false|$BIG
spans_engine_4096_blocks|true|$BIG, "num_kv_blocks": 4096
CONFIGS
# the span request on an engine of 8,192 KV blocks (1.5 GiB at 0.8B), nothing preallocated
t=$SECONDS
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $((${TOTAL:-560} - SECONDS + T0 - 10)) python3 -m \
  benchmarks.cli hybrid-spans --no-warmup --num-kv-blocks ${SPAN_BLOCKS:-8192} \
  --json "$OUT/hybrid_spans.json" > "$OUT/hybrid_spans.txt" 2>&1
echo "hybrid-spans --no-warmup --num-kv-blocks ${SPAN_BLOCKS:-8192} rc=$? ($((SECONDS - t)) s)" >> "$R"
grep -E "^(call|[a-g] )|goal .*/|^    (prefill|decode)|^    kind" "$OUT/hybrid_spans.txt" \
  | grep -v "^W1" | sed -n 1,40p | cut -c1-170 >> "$R"
echo "== total t=$((SECONDS-T0)) s" >> "$R"
cat "$R"
