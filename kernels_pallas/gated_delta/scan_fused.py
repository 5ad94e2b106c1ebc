"""Sequential state scan of the fused chunked gated delta rule (Pallas, Triton backend).

Grid (N, Hv, Dv / BV): each program walks all chunks of one sequence for one value head and BV
value columns, its float32 state slice in registers. Per chunk c (rows of the [N, T, H, D] inputs):
    states[c] = S (dot dtype, for the output kernel); S (float32) if c is a checkpoint boundary
    V' = U_c - W_c S ;  S = exp(gc_last) S + KD_c^T V'
Two state layouts:
  - "kv": S is [Dk, BV]; S and V' are the right-hand (B) operands of the two MMAs, so each step
    moves them from the accumulator layout through shared memory.
  - "vk": S^T is [BV, Dk] (like fla's state_v_first); V'^T = U^T - S^T W^T and
    S^T = exp(gc_last) S^T + V'^T KD make S^T and V'^T the left-hand (A) operands, which Triton can
    feed from registers; W and KD, loaded from memory, are the B operands. The per-chunk states
    come out as [.., Dv, Dk] (the output kernel reads them so); the final state is transposed
    back by the wrapper, "segments" checkpoints by the kernel (one store per checkpoint).
Checkpoints (the carried float32 state at chunk boundaries): "segments" runs the chunk loop from
one sorted boundary to the next and stores the state in between (default: no per-chunk
checkpoint code), "when" branches on a per-boundary slot map every chunk, "mask" stores
predicated (costs in benchmarks/history/gated_delta.md); with no checkpoints asked the kernel
has no checkpoint code at all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta.dots import dot as _dot, dot_t as _dot_t, dot_tn as _dot_tn

LAYOUTS = ("kv", "vk")
CKPT_STORES = ("segments", "when", "mask")


def step(c, s, w_ref, u_ref, kd_ref, dl_ref, vnew_ref, *, chunk, dot_dtype, layout, src=None):
    """One chunk: V' (stored) from the state s entering chunk c, and the state leaving it.
    u_ref None: U = 0 (a transition: the state carries the chunk maps' product, affine.py), and
    vnew_ref None: V' is not stored. src: None, or the chunk whose W, U, KD and decay chunk c
    reads (a borrowed chunk: joint.joint_packing); V' is stored at c either way."""
    src = c if src is None else src
    rows = pl.ds(pl.multiple_of(src * chunk, chunk), chunk)
    out = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    if layout == "kv":  # s [Dk, BV]
        ws = _dot(w_ref[rows, :], s, dot_dtype)
        v_new = -ws if u_ref is None else u_ref[rows, :].astype(jnp.float32) - ws
        if vnew_ref is not None:
            vnew_ref[out, :] = v_new.astype(vnew_ref.dtype)
        return s * dl_ref[src] + _dot_tn(kd_ref[rows, :], v_new, dot_dtype)
    # s = S^T [BV, Dk]
    sw = _dot_t(s, w_ref[rows, :], dot_dtype)
    v_t = -sw if u_ref is None else u_ref[rows, :].astype(jnp.float32).T - sw
    if vnew_ref is not None:
        vnew_ref[out, :] = v_t.T.astype(vnew_ref.dtype)
    return s * dl_ref[src] + _dot(v_t, kd_ref[rows, :], dot_dtype)


def saver(slot_ref, ckpt_ref, store="when"):
    """save(c, s): write s to checkpoint slot slot_ref[c] if that is >= 0 (no-op without slots)."""
    if slot_ref is None:
        return lambda c, s: None

    def save(c, s):
        slot = slot_ref[c]
        if store == "mask":
            plgpu.store(ckpt_ref.at[jnp.maximum(slot, 0)], s,
                        mask=jnp.broadcast_to(slot >= 0, s.shape))
            return

        @pl.when(slot >= 0)
        def _():
            ckpt_ref[slot] = s
    return save


def _scan_kernel(w_ref, u_ref, kd_ref, dl_ref, s0_ref, *refs, n_chunks, chunk, dot_dtype, layout,
                 store, n_ckpt):
    # w/kd [T, Dk]; u/vnew [T, BV]; dl [NT]; "kv": s0/final [Dk, BV],
    # states [NT, Dk, BV]; "vk": the same with the last two axes swapped.
    # "segments": bnd/order [M] (sorted boundaries, their checkpoint index), ckpt [M, Dk, BV];
    # "when"/"mask": slot [NT + 1], ckpt [M, Dk, BV] ("kv") / [M, BV, Dk] ("vk")
    slot_ref = bnd_ref = order_ref = ckpt_ref = None
    if not n_ckpt:
        vnew_ref, states_ref, final_ref = refs
    elif store == "segments":
        bnd_ref, order_ref, vnew_ref, states_ref, final_ref, ckpt_ref = refs
    else:
        slot_ref, vnew_ref, states_ref, final_ref, ckpt_ref = refs
    save = saver(slot_ref, ckpt_ref, store)

    def body(c, s):
        states_ref[c] = s.astype(states_ref.dtype)
        save(c, s)
        return step(c, s, w_ref, u_ref, kd_ref, dl_ref, vnew_ref, chunk=chunk,
                    dot_dtype=dot_dtype, layout=layout)

    s, start = s0_ref[...].astype(jnp.float32), 0
    if bnd_ref is not None:  # run up to each boundary in turn; the loops hold no checkpoint code
        def segment(p, carry):
            s, start = carry
            end = bnd_ref[p]
            s = jax.lax.fori_loop(start, end, body, s)
            ckpt_ref[order_ref[p]] = s.T if layout == "vk" else s
            return s, end
        s, start = jax.lax.fori_loop(0, n_ckpt, segment, (s, jnp.int32(0)))
    s = jax.lax.fori_loop(start, n_chunks, body, s)
    final_ref[...] = s
    save(n_chunks, s)


def state_scan(w, u, kd, dl, state0, ckpt_idx=None, *, chunk=64, block_v=16, layout="vk",
               ckpt_store="segments", dot_dtype=None, num_warps=4, num_stages=3,
               interpret=False):
    """Run the scan kernel.

    Args:
      w, kd: [N, T, Hv, Dk]; u: [N, T, Hv, Dv] (from the intra-chunk kernel).
      dl: [N, Hv, NT] float32 per-chunk total decay exp(gc_last).
      state0: [N, Hv, Dk, Dv] float32.
      ckpt_idx: None or [N, M] int32 chunk boundaries in [0, NT] (boundary j = the state entering
        chunk j; NT = the final state) whose carried float32 state to return; repeats allowed.
      ckpt_store: "segments" (the chunk loop runs from one sorted boundary to the next and
        stores the state in between: no per-chunk checkpoint code), "when" (a branch on a
        per-boundary slot map each chunk) or "mask" (a predicated store each chunk).
    Returns:
      v_new [N, T, Hv, Dv] in dot dtype; the states entering each
      chunk, [N, Hv, NT, Dk, Dv] ("kv") or [N, Hv, NT, Dv, Dk] ("vk"), dot dtype; final
      [N, Hv, Dk, Dv] float32; checkpoints [N, M, Hv, Dk, Dv] float32 (None without ckpt_idx).
    """
    if layout not in LAYOUTS or ckpt_store not in CKPT_STORES:
        raise ValueError(f"gated_delta state_scan: layout must be one of {LAYOUTS} and ckpt_store "
                         f"one of {CKPT_STORES}, got {layout!r}, {ckpt_store!r}")
    n, t_len, hv, dk = w.shape
    dv = u.shape[-1]
    nt = t_len // chunk
    block_v = min(block_v, dv)
    if dv % block_v:
        raise ValueError(f"gated_delta state_scan: Dv={dv} not a multiple of block_v={block_v}")
    dot_dtype = w.dtype if dot_dtype is None else dot_dtype
    vk = layout == "vk"

    def st_spec(*lead):  # a [Dk, BV] ("kv") / [BV, Dk] ("vk") state block behind `lead` axes
        nl = len(lead)
        if vk:
            return pl.BlockSpec((None, None, *lead, block_v, dk),
                                lambda b, h, j: (b, h, *([0] * nl), j, 0))
        return pl.BlockSpec((None, None, *lead, dk, block_v),
                            lambda b, h, j: (b, h, *([0] * nl), 0, j))

    def st_shape(*lead, dtype):
        return jax.ShapeDtypeStruct((n, hv, *lead, *((dv, dk) if vk else (dk, dv))), dtype)

    seq_k = pl.BlockSpec((None, t_len, None, dk), lambda b, h, j: (b, 0, h, 0))
    seq_v = pl.BlockSpec((None, t_len, None, block_v), lambda b, h, j: (b, 0, h, j))
    s0 = jnp.swapaxes(state0, -1, -2) if vk else state0
    in_specs = [seq_k, seq_v, seq_k, pl.BlockSpec((None, None, nt), lambda b, h, j: (b, h, 0)),
                st_spec()]
    args = [w, u, kd, dl.astype(jnp.float32), s0.astype(jnp.float32)]
    out_specs = [seq_v, st_spec(nt), st_spec()]
    out_shape = [jax.ShapeDtypeStruct((n, t_len, hv, dv), dot_dtype),
                 st_shape(nt, dtype=dot_dtype), st_shape(dtype=jnp.float32)]
    n_ckpt = 0 if ckpt_idx is None else ckpt_idx.shape[1]
    slot_map = None
    if n_ckpt:
        specs, extra, o_spec, o_shape, slot_map = _checkpoint_operands(
            ckpt_idx, ckpt_store, (n, nt, hv, dk, dv), block_v, st_spec, st_shape)
        in_specs += specs
        args += extra
        out_specs.append(o_spec)
        out_shape.append(o_shape)
    outs = pl.pallas_call(
        functools.partial(_scan_kernel, n_chunks=nt, chunk=chunk, dot_dtype=dot_dtype,
                          layout=layout, store=ckpt_store, n_ckpt=n_ckpt),
        grid=(n, hv, dv // block_v),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*args)
    v_new, states, final = outs[:3]
    if vk:
        final = jnp.swapaxes(final, -1, -2)
    ckpt = None
    if slot_map is not None:
        ckpt = jnp.swapaxes(outs[3], -1, -2) if vk else outs[3]  # [N, Hv, slots, Dk, Dv]
        winner = jnp.take_along_axis(slot_map, ckpt_idx, axis=1)  # [N, M] slot holding each
        ckpt = jnp.moveaxis(jnp.take_along_axis(ckpt, winner[:, None, :, None, None], axis=2),
                            2, 1)
    elif n_ckpt:
        ckpt = outs[3]
    return v_new, states, final, ckpt


def _checkpoint_operands(ckpt_idx, ckpt_store, dims, block_v, st_spec, st_shape):
    """The scan kernel's checkpoint operands, dims = (N, NT, Hv, Dk, Dv): the sorted boundaries
    and their order ("segments", the output written straight in the returned layout), or a
    per-boundary slot map ("when" / "mask"; repeats share one slot). Returns (in_specs, args,
    out_spec, out_shape, the slot map or None)."""
    n, nt, hv, dk, dv = dims
    n_ckpt = ckpt_idx.shape[1]
    per_seq = lambda m: pl.BlockSpec((None, m), lambda b, h, j: (b, 0))  # noqa: E731
    if ckpt_store == "segments":
        ckpt_idx = jnp.clip(ckpt_idx.astype(jnp.int32), 0, nt)
        order = jnp.argsort(ckpt_idx, axis=1).astype(jnp.int32)
        # written in the returned layout: a [Dk, BV] block of [N, M, Hv, Dk, Dv]
        return ([per_seq(n_ckpt), per_seq(n_ckpt)],
                [jnp.take_along_axis(ckpt_idx, order, axis=1), order],
                pl.BlockSpec((None, n_ckpt, None, dk, block_v), lambda b, h, j: (b, 0, h, 0, j)),
                jax.ShapeDtypeStruct((n, n_ckpt, hv, dk, dv), jnp.float32), None)
    # slot_map[n, j]: the slot boundary j writes (-1: none); repeats share one
    slot_map = jnp.full((n, nt + 1), -1, jnp.int32).at[jnp.arange(n)[:, None], ckpt_idx].set(
        jnp.arange(n_ckpt, dtype=jnp.int32)[None, :])
    return ([per_seq(nt + 1)], [slot_map], st_spec(n_ckpt),
            st_shape(n_ckpt, dtype=jnp.float32), slot_map)
