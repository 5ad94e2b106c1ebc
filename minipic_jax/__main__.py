"""`python -m minipic_jax [generate|run-batch] ...` (also the `minipic` console script).

    generate   the demo batch on the embedded default model (minipic_jax/cli.py; the default)
    run-batch  an offline job over a JSONL file (minipic_jax/batch/run_batch.py)
"""

from __future__ import annotations

import sys

SUBCOMMANDS = {"generate": "minipic_jax.cli", "run-batch": "minipic_jax.batch.run_batch"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "generate"
    if argv and argv[0] in SUBCOMMANDS:
        name = argv.pop(0)
    elif argv and not argv[0].startswith("-"):
        print(f"minipic: unknown subcommand {argv[0]!r}; use one of {sorted(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(SUBCOMMANDS[name]).main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
