"""One line per (configuration, workload) of saved `minipic-bench rag` runs, plus the
composition cost where measured.

Each configuration's run is read from `<root>/rag_<config>/rag_bench.json`, the folder
`benchmarks/runs/i19_device_s9.sh` passes to `rag --out`.
Usage: python3 benchmarks/runs/rag_table.py [--root DIR] [config ...]
(defaults: --root /tmp, configs fcfs pic_off)."""
import argparse
import json
from pathlib import Path


def table_lines(root, configs):
    """The table's lines for `configs`, read from `root`; a missing or unreadable run is a line."""
    lines = []
    for c in configs:
        path = Path(root) / f"rag_{c}" / "rag_bench.json"
        try:
            d = json.loads(path.read_text())["results"][0]
        except (OSError, ValueError, KeyError, IndexError) as e:
            lines.append(f"{c} no result ({path}): {e!r}")
            continue
        for r in d.get("runs", []):
            lines.append(
                f"{c:8s} {r['workload']:5s} {r['requests_per_second']:6.2f} req/s  "
                f"hit {r['prefix_cache_hit_rate']:.3f}  "
                f"computed {r['computed_prompt_tokens_per_second'] * r['elapsed_time']:7.0f}  "
                f"steps {r['steps']:3d}  ms/step {1e3 * r['elapsed_time'] / r['steps']:6.2f}  "
                f"TPOT p50 {r['median_tpot_ms']:6.2f}  TTFT p50 {r['median_ttft_ms']:7.1f}")
        cc = d.get("compose_cost")
        if cc and "step_ms" in cc:
            lines.append(
                f"compose: step {cc['step_ms']:.2f} ms, composition {cc['compose_ms']:.3f} ms = "
                f"{cc['compose_share']:.2%}, per span {cc['per_span_ms']:.3f} ms = "
                f"{cc['per_span_share']:.3%}, synthetic {cc['synthetic_compose_ms']}")
    return lines


def main(argv=None):
    """Print the table of the configurations named on the command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=["fcfs", "pic_off"])
    ap.add_argument("--root", default="/tmp", help="folder holding rag_<config>/ (default /tmp)")
    args = ap.parse_args(argv)
    for line in table_lines(args.root, args.configs):
        print(line)


if __name__ == "__main__":
    main()
