"""A ragged step's checkpoints as flat rows: CheckpointRows(seq [K], pos [K]) names each
checkpoint's sequence and absolute position (-1: an unused row). The older per-sequence form,
an [S, M] array of positions, holds S M rows whatever the step takes; the states a step returns
are one per row, so the flat form's K (a small static bound the caller keeps) is what a step
writes and moves, not S M (issue 29: at 64 seats and M = 8, 576 states of 1 MiB per GDN layer).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class CheckpointRows(NamedTuple):
    seq: object  # [K] int32 the row's sequence in the step (ignored where pos < 0)
    pos: object  # [K] int32 absolute position of the checkpoint, -1 = none


def as_rows(checkpoint_at):
    """(CheckpointRows, shape of the per-row results' leading axes): [S, M] positions become
    S M rows (results then [S, M, ...], as before); CheckpointRows pass through ([K, ...])."""
    if isinstance(checkpoint_at, CheckpointRows):
        seq = jnp.maximum(jnp.asarray(checkpoint_at.seq, jnp.int32), 0)  # unused rows: seq 0
        pos = jnp.asarray(checkpoint_at.pos, jnp.int32)
        return CheckpointRows(seq, pos), pos.shape
    at = jnp.asarray(checkpoint_at, jnp.int32)
    s, m = at.shape
    seq = jnp.repeat(jnp.arange(s, dtype=jnp.int32), m)
    return CheckpointRows(seq, at.reshape(-1)), at.shape
