"""A decode step's GDN causal conv read straight from the conv state (qwen3_5_gdn's
DECODE_CONV_DIRECT / DECODE_SEQ_ROWS forms): with at most one new token per sequence, a row's
Kc - 1 earlier inputs are its sequence's conv state columns, and the state moves on by that one
row, so no per-row history index, shifted copies or per-tap gathers (the same values as
qwen3_5_gdn.shifted_taps / read_history there: tests/test_decode_conv.py)."""

from __future__ import annotations

import jax.numpy as jnp


def decode_taps(x, conv0, seq_of_row=None):
    """A decode step's conv inputs as Kc arrays [T, C] (oldest first): row t's Kc - 1 earlier
    inputs are the conv state columns of its sequence (one new token each), then x itself.
    x [T, C]; conv0 [S, C, Kc-1]; seq_of_row [T], or None: x is per sequence ([S, C], row i
    sequence i's). The same values as shifted_taps there."""
    old = conv0.astype(x.dtype)
    old = old if seq_of_row is None else old[seq_of_row]  # [T, C, Kc-1]
    return [old[:, :, j] for j in range(conv0.shape[-1])] + [x]


def decode_history(x, conv0, cu_q_lens, per_seq: bool = False):
    """A decode step's conv states after it, [S, C, Kc-1]: each sequence with a new row moves
    its window on by that row, the others keep theirs (read_history's values there: the state's
    columns pass through x's dtype as read_history's do). per_seq: x is [S, C] per sequence."""
    n = x.shape[0]
    has_row = (cu_q_lens[1:] > cu_q_lens[:-1])[:, None, None]
    new = x if per_seq else x[jnp.clip(cu_q_lens[:-1], 0, n - 1)]  # [S, C]
    old = conv0.astype(x.dtype)
    moved = jnp.concatenate([old[:, :, 1:], new[:, :, None]], axis=-1)
    return jnp.where(has_row, moved, old).astype(conv0.dtype)
