"""One line per (configuration, workload) of the rag runs under /tmp/rag_<config>/ (as
benchmarks/runs/i19_device_s9.sh writes them), plus the composition cost where measured.
Usage: python3 benchmarks/runs/rag_table.py [config ...] (default: fcfs pic_off)."""
import json
import sys

for c in sys.argv[1:] or ("fcfs", "pic_off"):
    try:
        d = json.load(open(f"/tmp/rag_{c}/rag_bench.json"))["results"][0]
    except Exception as e:  # noqa: BLE001 - a missing run is a line of the table
        print(c, "no result", e)
        continue
    for r in d.get("runs", []):
        print(f"{c:8s} {r['workload']:5s} {r['requests_per_second']:6.2f} req/s  "
              f"hit {r['prefix_cache_hit_rate']:.3f}  "
              f"computed {r['computed_prompt_tokens_per_second'] * r['elapsed_time']:7.0f}  "
              f"steps {r['steps']:3d}  ms/step {1e3 * r['elapsed_time'] / r['steps']:6.2f}  "
              f"TPOT p50 {r['median_tpot_ms']:6.2f}  TTFT p50 {r['median_ttft_ms']:7.1f}")
    cc = d.get("compose_cost")
    if cc and "step_ms" in cc:
        print(f"compose: step {cc['step_ms']:.2f} ms, composition {cc['compose_ms']:.3f} ms = "
              f"{cc['compose_share']:.2%}, per span {cc['per_span_ms']:.3f} ms = "
              f"{cc['per_span_share']:.3%}, synthetic {cc['synthetic_compose_ms']}")
