#!/bin/bash
# One 32K-token Qwen3.5-0.8B GDN layer against fla's chunk_gated_delta_rule in one process, as
# the session-20/28 device calls ran it (`gdn --variants fused fused_mosaic_out --profile`): the
# fla-core and einops wheels carried in .whl/ (`run` carry [".whl"]). Writes $OUT/gdn.txt;
# prints its rc and last lines (append them to a table).
# usage: OUT=$OUT LIMIT=seconds bash benchmarks/runs/gdn32k_device.sh >> table.txt
set -u; T0=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! ls .whl/fla_core*.whl > /dev/null 2>&1; then echo "gdn: no .whl/fla_core*.whl carried"; exit 0; fi
timeout 40 python3 -m pip install -q --no-deps --no-index --target /tmp/site \
  .whl/fla_core*.whl .whl/einops*.whl > /dev/null 2>&1
PYTHONPATH=$PWD:/tmp/site timeout ${LIMIT:-120} python3 -m benchmarks.cli gdn --tokens 32768 \
  --reps 5 --variants fused fused_mosaic_out --profile > "$OUT/gdn.txt" 2>&1
echo "gdn rc=$? ($((SECONDS-T0)) s)"
grep -v "^W1" "$OUT/gdn.txt" | tail -12 | cut -c1-200
