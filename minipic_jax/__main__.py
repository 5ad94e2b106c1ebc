"""`python -m minipic_jax [args]`: the generate CLI (minipic_jax/cli.py, `minipic-generate`)."""

from minipic_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
