"""The recurrence of a Qwen3.5 GDN layer over a step's rows (qwen3_5_gdn.GatedDeltaNet's core):
the flow, each sequence from its state, and with span pieces the local pass and the captured
transitions, as one stream where the step planned one; and the decode step's state cache the
in-place kernels step. qwen3_5_gdn re-exports both names."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.sharding import ragged_gated_delta
from minipic_jax.models import qwen3_5_joint, qwen3_5_spans


def recurrent_core(x, cu_q_lens, pos0, delta0, pieces, *, checkpoint_at, decode, packing,
                   **kernel):
    """The gated delta rule over the step's rows x = (q, k, v, g, beta): the flow (each
    sequence from its state) and, with span pieces, the local pass (span rows read it) and the
    captured pieces' transitions, as one stream where the step planned one (qwen3_5_joint),
    else pass by pass. Returns (core [T, Hv, Dv] float32, delta [S], checkpoints or None, local
    finals or None, transitions or None)."""
    if pieces is not None and "joint" in pieces:  # flow, local, transition: one stream
        return qwen3_5_joint.run(*x, delta0, pos0, pieces["joint"], pieces, checkpoint_at,
                                 **kernel)
    core, delta, delta_ck = ragged_gated_delta(*x, cu_q_lens, pos0, delta0,
                                               checkpoint_at=checkpoint_at, decode=decode,
                                               packing=packing, **kernel)
    local_final = a_span = None
    if pieces is not None:  # span rows: outputs of their piece from a zero state
        local, local_final, a_span = qwen3_5_spans.run_local(*x, pieces["packings"],
                                                             plan=pieces, **kernel)
        core = jnp.where(pieces["row_span"][:, None, None], local, core)
    return core, delta, delta_ck, local_final, a_span


class StateCache(NamedTuple):
    """A decode step's GDN state cache, stepped in place (GatedDeltaNet's state_cache)."""
    cache: jax.Array  # [P, Hv, Dk, Dv] float32
    slots: jax.Array  # [S] int32 each sequence's slot
    keep: jax.Array  # [S] bool: False starts the sequence from zeros
    glue: bool  # the layer's l2 norms, gates and gated norm in the same kernel
    conv: jax.Array | None = None  # [P, C, Kc-1] the conv state cache (with glue): the conv too
