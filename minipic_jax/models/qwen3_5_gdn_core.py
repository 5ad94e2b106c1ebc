"""The recurrence of a Qwen3.5 GDN layer over a step's rows (qwen3_5_gdn.GatedDeltaNet's core):
the flow, each sequence from its state, and with span pieces the local pass and the captured
transitions, as one stream where the step planned one; a prefill step's one-row sequences
stepped by the decode kernel; and the decode step's state cache the in-place kernels step.
qwen3_5_gdn re-exports recurrent_core and StateCache."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta.api import ZERO, StateRows
from kernels_pallas.gated_delta.api import one_rows_in_place as gdn_one_rows
from kernels_pallas.sharding import ragged_gated_delta
from minipic_jax.models import qwen3_5_joint, qwen3_5_spans


def recurrent_core(x, cu_q_lens, pos0, delta0, pieces, *, checkpoint_at, decode, packing,
                   one_row=None, seq_of_row=None, **kernel):
    """The gated delta rule over the step's rows x = (q, k, v, g, beta): the flow (each
    sequence from its state) and, with span pieces, the local pass (span rows read it) and the
    captured pieces' transitions, as one stream where the step planned one (qwen3_5_joint),
    else pass by pass. Returns (core [T, Hv, Dv] float32, delta [S], checkpoints or None, local
    finals or None, transitions or None). one_row: None, or [S] bool the sequences `packing`
    skips, stepped by the decode kernel after the chunked pass (`one_rows_in_place`)."""
    if pieces is not None and "joint" in pieces:  # flow, local, transition: one stream
        core, delta, delta_ck, local_final, a_span = qwen3_5_joint.run(
            *x, delta0, pos0, pieces["joint"], pieces, checkpoint_at, **kernel)
        if one_row is not None:
            core, delta = one_rows_in_place(x, cu_q_lens, one_row, seq_of_row, core, delta,
                                            delta0, kernel["interpret"])
        return core, delta, delta_ck, local_final, a_span
    core, delta, delta_ck = ragged_gated_delta(*x, cu_q_lens, pos0, delta0,
                                               checkpoint_at=checkpoint_at, decode=decode,
                                               packing=packing, **kernel)
    if one_row is not None:
        core, delta = one_rows_in_place(x, cu_q_lens, one_row, seq_of_row, core, delta, delta0,
                                        kernel["interpret"])
    local_final = a_span = None
    if pieces is not None:  # span rows: outputs of their piece from a zero state
        local, local_final, a_span = qwen3_5_spans.run_local(*x, pieces["packings"],
                                                             plan=pieces, **kernel)
        core = jnp.where(pieces["row_span"][:, None, None], local, core)
    return core, delta, delta_ck, local_final, a_span


def one_rows_in_place(x, cu_q_lens, one_row, seq_of_row, core, delta, delta0, interpret):
    """A prefill step's one-row sequences (`one_row` [S], skipped by the chunked pass) stepped
    by the decode kernel after it: (core [T, Hv, Dv] with their rows' outputs, delta). delta is
    what the chunked pass returned: the state cache with its finals written (delta0 a
    write_final StateRows: the rows' slots and resets are its own), else the [S] finals, where
    a skipped sequence's is the state it starts from (zeros on a reset): stepped in place
    there, sequence i at row i."""
    if isinstance(delta0, StateRows) and delta0.write_final:
        slots, keep = delta0.index, delta0.kind != ZERO
    else:
        slots = jnp.arange(one_row.shape[0], dtype=jnp.int32)
        keep = jnp.ones(one_row.shape, bool)
    out_s, delta = gdn_one_rows(*x, cu_q_lens, one_row, delta, slots, keep, interpret=interpret)
    rows = jnp.arange(core.shape[0], dtype=jnp.int32)
    mine = (one_row[seq_of_row] & (rows < cu_q_lens[-1]))[:, None, None]
    return jnp.where(mine, out_s[seq_of_row], core), delta


class StateCache(NamedTuple):
    """A decode step's GDN state cache, stepped in place (GatedDeltaNet's state_cache)."""
    cache: jax.Array  # [P, Hv, Dk, Dv] float32
    slots: jax.Array  # [S] int32 each sequence's slot
    keep: jax.Array  # [S] bool: False starts the sequence from zeros
    glue: bool  # the layer's l2 norms, gates and gated norm in the same kernel
    conv: jax.Array | None = None  # [P, C, Kc-1] the conv state cache (with glue): the conv too
