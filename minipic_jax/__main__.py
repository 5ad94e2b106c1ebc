"""`python -m minipic_jax {generate|run-batch|train} ...` (also `./minipic`, which adds `test`
and `bench`).

    generate   the demo batch on the embedded default model (minipic_jax/cli.py; the default)
    run-batch  an offline job over a JSONL file (minipic_jax/batch/run_batch.py)
    train      block-attention fine-tuning, then an HF export (minipic_jax/training/cli.py)
"""

from __future__ import annotations

import sys

SUBCOMMANDS = {"generate": "minipic_jax.cli", "run-batch": "minipic_jax.batch.run_batch",
               "train": "minipic_jax.training.cli"}
USAGE = """usage: python -m minipic_jax [SUBCOMMAND] [options]

subcommands (`SUBCOMMAND --help` lists each one's options):
  generate   batch generation on the embedded default model, no download (the default)
  run-batch  an offline job over a JSONL file in the OpenAI batch format (resumable)
  train      block-attention fine-tuning from a JSONL file, then an HF export

The same commands are installed as console scripts in the environment minipic-jax was installed
into (./minipic's is .venv): minipic, minipic-generate, minipic-train, minipic-bench.
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "generate"
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        name = argv.pop(0)
    elif argv and not argv[0].startswith("-"):
        print(f"minipic: unknown subcommand {argv[0]!r}; use one of {sorted(SUBCOMMANDS)} "
              f"(--help says what each does)", file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(SUBCOMMANDS[name]).main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
