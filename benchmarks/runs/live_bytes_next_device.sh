#!/bin/bash
# Next device session (one call on nvidia-h100-x1, ~6 min): settle the engine bench's out-of-memory
# at batch 128 on the 80 GB H100 (2026-12-05, sessions 18 and 19, both trees: the random K/V fill
# could not place one 530 MiB leaf after the warm-up).
# Cause found on CPU (585ecae): the fill's jit read each leaf for its shape only, so jit pruned the
# leaf, and its donation with it; every new leaf took fresh memory while the old pool stayed alive,
# weights 16 GB + 2 x 35.6 GB at the last leaf (batch 64: 16 + 2 x 17.8 fits, as seen). Everything
# else an engine holds is accounted for on CPU (benchmarks/live_bytes.py: no live array without
# an owner at any stage). This call checks it where it failed:
#   1. the fill A/B alone: 16 leaves of 530 MiB; before 585ecae bytes_in_use grows 530 MiB a leaf,
#      now it stays flat (seconds);
#   2. memory_stats() after each stage of the bench at batch 128 (copy anchor, load, warm-up,
#      primed, fill with per-leaf figures, decode steps), beyond-live bytes = what the allocator
#      holds that no array explains (executables, temporaries, fragmentation), and XLA's
#      temporaries per step variant (~2.5 min);
#   3. the command that failed, at batch 128: it should now print its decode line (~2 min).
# usage: OUT=$OUT bash benchmarks/runs/live_bytes_next_device.sh
set -u; T0=$SECONDS
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=/tmp/jcc
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}  # as on 2026-12-05
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/gpu.txt" 2>&1; cat "$OUT/gpu.txt"
timeout 90 python3 -m benchmarks.live_bytes --fill-ab --leaves 16 --leaf-mib 530 \
  --out "$OUT/fill_ab" > "$OUT/fill_ab.txt" 2>&1
echo "== 1. fill A/B rc=$? t=$((SECONDS - T0)) s"; grep "^fill" "$OUT/fill_ab.txt" | cut -c1-400
timeout 270 python3 -m benchmarks.live_bytes --batch 128 --max-num-batched-tokens 512 \
  --min-token-bucket 128 --out "$OUT/stages" > "$OUT/stages.txt" 2>&1
echo "== 2. stages at batch 128 rc=$? t=$((SECONDS - T0)) s"
grep -E "^\[|temporaries" "$OUT/stages.txt" | cut -c1-600
python3 - "$OUT/stages/live_bytes.json" <<'PY' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["stages"]
fill = next(r for r in rows if r["stage"] == "random K/V filled")
used = [d.get("bytes_in_use") for d in fill["per_leaf_device_MiB"]]
print(f"fill: bytes_in_use per leaf (MiB) first {used[:3]} last {used[-3:]}")
PY
timeout $((580 - SECONDS + T0)) python3 -m benchmarks.cli engine --max-num-batched-tokens 512 \
  --min-token-bucket 128 --skip-run --batch 128 --out "$OUT/engine_128" > "$OUT/engine_128.txt" 2>&1
echo "== 3. engine bench batch 128 rc=$? t=$((SECONDS - T0)) s"
grep -v "^W1\|^If this\|^Current alloc" "$OUT/engine_128.txt" | tail -4 | cut -c1-400
