"""`minipic-bench`: one entry point, one module per subcommand.

    minipic-bench planner --help
    python -m benchmarks.cli planner ...

A subcommand module provides `add_parser(parser)` (adds its arguments to the given argparse
parser) and `run(args) -> int | None`. Register it in COMMANDS; only the chosen module is imported,
so a subcommand's heavy imports (jax, torch) never slow down the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "attention": ("benchmarks.attention_bench",
                  "paged attention kernel: decode TB/s, prefill TFLOP/s, RoPE-at-read overhead"),
    "planner": ("benchmarks.planner_bench",
                "checkpoint placement: token savings vs budget per strategy, DP timing, drift"),
    "gdn": ("benchmarks.gdn_bench",
            "Gated DeltaNet chunked prefill (XLA / Pallas) vs fla chunk_gated_delta_rule"),
    "gdn-engine": ("benchmarks.gdn_engine_ab",
                   "hybrid engine, gated delta kernel A/B (Config.gdn.impl): greedy agreement, "
                   "prefill step ms"),
    "engine": ("benchmarks.engine_bench",
               "paged engine: decode step vs memory floor, host share, compiles over a 1000-request run"),
    "hybrid-cache": ("benchmarks.hybrid_cache_bench",
                     "hybrid prefix caching: tokens recomputed, hit rate, TTFT, wall per checkpoint strategy"),
    "hybrid-step": ("benchmarks.hybrid_step_profile",
                    "hybrid engine step by kind (decode / prefill per bucket): wall, kernels, trace"),
    "route": ("benchmarks.route_bench",
              "data-parallel replicas: span-aware vs random routing, cache hit rate (host only)"),
    "write-kv": ("benchmarks.write_kv_bench", "K/V cache write of one layer: unique-index scatter vs plain"),
    "rag": ("benchmarks.rag_bench",
            "RAG headline on MuSiQue: rotated / pic_off / position_free x (fcfs, barrier, isps), "
            "offline + online, cached-span TTFT, load and warm-up times"),
    "hybrid-spans": ("benchmarks.hybrid_span_request",
                     "issue 29's span request on a started hybrid engine: compiles, cold vs "
                     "plain, reordered vs cold, 4,096-token spans"),
    "ttft-host": ("benchmarks.ttft_host",
                  "cached-span TTFT request through LLM.generate, step stubbed: host ms per part"),
    "block-ft": ("benchmarks.block_ft_bench",
                 "synthetic multi-document task: full attention vs Block-Attention vs block FT"),
    "cpu-vs-hf": ("benchmarks.cpu_vs_hf",
                  "CPU: this engine vs HF transformers, same weights, prompts, threads, float32"),
    "lower-time": ("benchmarks.lower_time",
                   "trace and lower (for CUDA, on this CPU) of the engine's step variants at a "
                   "preset's shape, abstract weights; cProfile top list"),
    "train": ("benchmarks.train_bench",
              "block fine-tuning step at a ~1B Llama shape: tokens/s and MFU vs a measured matmul"),
    "rl": ("benchmarks.rl_bench",
           "GRPO loop with engine rollouts (reward curve, time split); --update-timing, "
           "--rollout-compare"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="minipic-bench", description="minipic-jax benchmarks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_parser(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
