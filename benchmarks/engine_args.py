"""Options that several benchmarks pass to the engine, with one flag and one help text each, so
`--max-num-batched-tokens` means the same thing in every subcommand. A benchmark picks the
options it takes and its own defaults:

    add_options(p, engine_options(dtype="bfloat16", max_num_batched_tokens=1024))
    add_options(p, {"out": out_option("route_bench.json")})

`engine_options` returns argparse keyword arguments by option name, so a benchmark that hands its
options on to worker processes (rag_bench's OPTIONS table) can merge them into its own table."""

from __future__ import annotations

import os

# option name -> (argparse type, help); each help names the engine setting it becomes
ENGINE_OPTIONS = {
    "model": (str, "preset name or HF folder (presets get random weights)"),
    "dtype": (str, "model and KV cache dtype"),
    "max_num_seqs": (int, "Config.max_num_seqs (sequences per step)"),
    "max_num_batched_tokens": (int, "Config.max_num_batched_tokens (query tokens per step)"),
    "min_token_bucket": (int, "Config.min_token_bucket (smallest padded step size)"),
    "max_model_len": (int, "Config.max_model_len (longest prompt + output)"),
    "num_kv_blocks": (int, "KV pool blocks (None: from free memory)"),
    "block_size": (int, "Config.block_size (tokens per KV block)"),
    "max_tokens": (int, "output tokens per request (EOS ignored)"),
    "tensor_parallel_size": (int, "devices the model is split over (Config.tensor_parallel_size)"),
    "step_command_buffer": (str, "Config.compilation.command_buffer: xla, off, on or a comma "
                                 "list of XLA command-buffer types (GPU only)"),
}


def engine_options(**defaults) -> dict:
    """name -> argparse kwargs for the named engine options, with the benchmark's defaults."""
    unknown = sorted(set(defaults) - set(ENGINE_OPTIONS))
    if unknown:
        raise ValueError(f"engine_options: unknown option(s) {unknown}; "
                         f"known: {sorted(ENGINE_OPTIONS)}")
    return {name: dict(type=ENGINE_OPTIONS[name][0], default=default,
                       help=ENGINE_OPTIONS[name][1] + " (default: %(default)s)")
            for name, default in defaults.items()}


def out_option(what: str) -> dict:
    """argparse kwargs of --out: the folder a benchmark writes `what` into ($OUT or .)."""
    return dict(default=os.environ.get("OUT", "."),
                help=f"folder for {what} (default: $OUT or the current folder)")


def add_options(p, options: dict) -> None:
    """Add options given as name -> argparse kwargs (name with underscores, flag with dashes)."""
    for name, kw in options.items():
        p.add_argument("--" + name.replace("_", "-"), **kw)
