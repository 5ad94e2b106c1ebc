"""Where a Qwen3.5 GDN layer's causal conv reads its inputs in a ragged step: each row's window
of the Kc - 1 inputs before it (in the step's new rows, or the sequence's conv state), each
sequence's state after its new rows and at its checkpoints. Metadata only: a step computes it
once for all its GDN layers (qwen3_5_gdn.py uses it; shape letters there)."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.gated_delta.api import as_rows


def history_index(cu_q_lens, pos0, seq, end_pos, n_tokens: int, hist: int):
    """Where the hist = Kc - 1 conv inputs just before positions `end_pos` [...] of sequences
    `seq` [...] are (in the new inputs, T rows, or in the conv state: the inputs before pos0,
    oldest first): metadata only, so a step computes it once for all its GDN layers.
    Returns (rows [..., hist] of the new inputs, conv-state index (seq, column) [..., hist] each,
    from_x [..., hist] bool: the new inputs hold it, else the state)."""
    offs = jnp.arange(hist, dtype=jnp.int32) - hist  # -(Kc-1) .. -1
    rel = end_pos[..., None] - pos0[seq][..., None] + offs  # [..., Kc-1] relative to pos0
    rows = jnp.clip(cu_q_lens[seq][..., None] + rel, 0, n_tokens - 1)
    seq_b = jnp.broadcast_to(seq[..., None], rel.shape)
    return rows, seq_b, jnp.clip(hist + rel, 0, hist - 1), rel >= 0


def read_history(x, conv0, index):
    """The conv inputs `history_index` located: x [T, C] new inputs, conv0 [S, C, Kc-1] those
    before pos0 (oldest first). Returns [..., C, Kc - 1] (a conv state's layout)."""
    return jnp.swapaxes(history_rows(x, conv0, index), -1, -2)


def history_rows(x, conv0, index):
    """read_history's inputs as rows [..., Kc - 1, C] (oldest first)."""
    rows, seq, col, from_x = index
    # indices are in range (clipped): no negative-index wrap ops
    new = x.at[rows].get(wrap_negative_indices=False)
    old = conv0.at[seq, :, col].get(wrap_negative_indices=False)
    return jnp.where(from_x[..., None], new, old.astype(x.dtype))


def rows_of_seqs(cu_q_lens, n_tokens: int):
    """[T] int32 the sequence of each row (padding rows: the last sequence's)."""
    rows = jnp.arange(n_tokens, dtype=jnp.int32)
    # compare_all: one [T, S+1] fusion; the default method is a while loop (kernels per level)
    return jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right", method="compare_all") - 1,
                    0, cu_q_lens.shape[0] - 2)


def conv_index(cu_q_lens, pos0, seq_of_row, hist: int, checkpoint_at=None):
    """The `history_index`es a GDN layer reads, once per step: each row's conv window ("rows"),
    each sequence's state after its new tokens ("end") and at its checkpoints ("ckpt")."""
    n_tokens = seq_of_row.shape[0]
    rows = jnp.arange(n_tokens, dtype=jnp.int32)
    end = pos0[seq_of_row] + rows - cu_q_lens[seq_of_row]  # position of each token
    seq_ids = jnp.arange(cu_q_lens.shape[0] - 1, dtype=jnp.int32)
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    index = dict(rows=history_index(cu_q_lens, pos0, seq_of_row, end, n_tokens, hist),
                 end=history_index(cu_q_lens, pos0, seq_ids, pos0 + lens, n_tokens, hist))
    if checkpoint_at is not None:  # per row (checkpoint_rows.py): [K] or [S, M] windows
        rows_, shape = as_rows(checkpoint_at)
        ck_pos = jnp.where(rows_.pos >= 0, rows_.pos, pos0[rows_.seq])
        index["ckpt"] = tuple(x.reshape(tuple(shape) + x.shape[1:]) for x in history_index(
            cu_q_lens, pos0, rows_.seq, ck_pos, n_tokens, hist))
    return index
