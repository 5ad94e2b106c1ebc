"""argparse helpers of the command lines: `type=` checks for numbers (a bad value is a usage
error naming the option, before any model is built, never a hang or a late traceback) and a help
formatter that shows each option's default."""

from __future__ import annotations

import argparse
import math


def int_at_least(low: int, high: int | None = None):
    """An int in [low, high] (high None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low or (high is not None and v > high):
            want = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {want}, got {v}")
        return v
    parse.__name__ = "integer"  # argparse's "invalid integer value" wording
    return parse


def float_at_least(low: float, *, strict: bool = False):
    """A finite float >= low (> low with strict)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if strict else '>='} {low:g}, got {text}")
        return v
    parse.__name__ = "number"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
seed_int = int_at_least(0, 2**63 - 1)  # JAX's PRNG key takes a 64-bit seed
positive_float = float_at_least(0.0, strict=True)
non_negative_float = float_at_least(0.0)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help lines end with "(default: X)", except where there is nothing to show (required
    options, None, flags that are off)."""

    def _get_help_string(self, action):
        if action.required or action.default is None or action.default is False \
                or action.help is None:
            return action.help
        return super()._get_help_string(action)
