"""One decode step of the gated delta rule, in place in the state cache, in Pallas (Triton lowering).

The XLA decode path of a GDN layer (`chunked.recurrent_step` between the model's gather of the
step's states out of the cache and its scatter of the new ones back) is a gather, the decay,
two batched dots, the rank-1 update and a scatter: five or more kernels a layer, each a pass over
the S states (1 MiB each at Qwen3.5-0.8B). Here one program per (row, value head, Dv block)
reads its [Dk, BV] block of the row's state straight from the cache by slot, runs the step in
registers and writes the block back to the same place (the cache is aliased in and out), with
the row's output:

    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (scale q)

A row whose `keep` is 0 starts from the zero state (a reset); a row with no token this step
(`has` 0: a padding row, or a sequence with no new token) leaves its state as it found it
(zeroed if not kept) and outputs zeros: exactly the one-step branch of
`api.ragged_gated_delta`. Padding rows share the engine's scratch slot, which nothing reads.

Triton rather than Mosaic GPU: the step is two reductions over the Dk axis of a float32
register tile and a rank-1 update, IEEE float32 as the XLA path (no tensor-core op fits a
matrix-vector product at this precision); Triton reduces across a tile's rows directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32


def _kernel(slot_ref, keep_ref, has_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref,
            o_ref, state_out_ref, *, rep, scale, block_v):
    # slot / keep / has [N] int32; q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv]; state
    # [P, Hv, Dk, Dv] float32 (the cache, aliased to state_out); o [N, Hv, Dv] float32
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
    slot, kh = slot_ref[n], h // rep
    s0 = jnp.where(keep_ref[n] != 0, state_ref[slot, h, :, cols], 0.0)  # [Dk, BV]
    q = q_ref[n, kh, :].astype(_F32) * scale  # [Dk]
    k = k_ref[n, kh, :].astype(_F32)
    v = v_ref[n, h, cols].astype(_F32)  # [BV]
    s = s0 * jnp.exp(g_ref[n, h].astype(_F32))
    kv = jnp.sum(k[:, None] * s, axis=0)  # [BV]
    s = s + k[:, None] * ((v - kv) * beta_ref[n, h].astype(_F32))[None, :]
    has = has_ref[n] != 0
    o_ref[n, h, cols] = jnp.where(has, jnp.sum(q[:, None] * s, axis=0), 0.0)
    state_out_ref[slot, h, :, cols] = jnp.where(has, s, s0)


def decode_in_place(q, k, v, g, beta, state, slots, keep, has, *, scale=None,
                    block_v: int | None = None, num_warps: int = 4, interpret: bool = False):
    """One gated delta step for each row, reading and writing the state cache in place.

    Args:
      q, k: [N, Hk, Dk] (normalized, the model's dtype); v: [N, Hv, Dv]; g, beta: [N, Hv] (the
        log decay and the write strength); state: [P, Hv, Dk, Dv] float32, the cache (donated:
        the result is written into it); slots: [N] int32 each row's state slot; keep, has: [N]
        bool (keep False: start from zeros; has False: no token, the state stays).
      scale: of q (None: Dk ** -0.5); block_v: value columns per program (divides Dv; None:
        min(32, Dv)); num_warps: per program.
    Returns:
      out [N, Hv, Dv] float32 (zeros where has is False), the updated cache [P, Hv, Dk, Dv].
    """
    rows, hk, dk = k.shape
    slots_n, hv, dk_s, dv = state.shape
    if q.shape != k.shape or v.shape[:2] != (rows, hv) or dk_s != dk or hv % hk:
        raise ValueError(f"decode_in_place: q {q.shape}, k {k.shape}, v {v.shape} do not fit the "
                         f"state cache {state.shape}")
    if state.dtype != _F32:
        raise ValueError(f"decode_in_place: the state cache must be float32, got {state.dtype}")
    block_v = min(32, dv) if block_v is None else block_v
    if dv % block_v:
        raise ValueError(f"decode_in_place: block_v {block_v} does not divide Dv {dv}")
    scale = dk ** -0.5 if scale is None else scale
    flags = [jnp.asarray(x).astype(jnp.int32) for x in (keep, has)]
    slots = jnp.clip(jnp.asarray(slots, jnp.int32), 0, slots_n - 1)  # never write outside
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    args = [slots, *flags, q, k, v, g, beta, state]
    kernel = functools.partial(_kernel, rep=hv // hk, scale=float(scale), block_v=block_v)
    out = jax.ShapeDtypeStruct((rows, hv, dv), _F32)
    return pl.pallas_call(
        kernel, grid=(rows, hv, dv // block_v),
        in_specs=[whole(x) for x in args],
        out_specs=[whole(out), whole(state)],
        out_shape=[out, jax.ShapeDtypeStruct(state.shape, _F32)],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_decode_in_place",
    )(*args)
