"""The inter-chunk state recurrence as a two-level (blocked) scan: a tree of depth two.

The sequential scan (scan_fused.py) walks all NT chunks of a sequence in one program per (head,
BV value columns): at one sequence x 16 heads that is 128 programs, each NT dependent steps,
so a long sequence is bound by the step latency, not by the device. Here the chunks are cut
into G segments of L = NT / G chunks and the recurrence runs in three passes:

  1. segment maps (`segment_maps`, grid (N G, Hv, (Dv + Dk) / BV)): each segment's affine map
     from a zero state and from the identity, i.e. in the transposed-state ("vk") layout
     R = S^T, R_end = R_start M_g + N_g with N_g the state the segment leaves from zero (rows
     [U | 0] from [0 | I]: the same step as the scan, Dk more rows, no per-chunk stores);
  2. the G segment maps composed in order from state0 (XLA; G small matmuls per head): every
     segment's entering state, the final state and the span transition;
  3. the sequential scan again, every segment from its entering state at once (grid
     (N G, Hv, Dv / BV), scan_fused.step), writing V', the per-chunk states (in the layout the
     output kernel reads, no transposes) and the float32 checkpoints of the chunk boundaries in
     that segment.

Each program walks L chunks instead of NT, and G times as many programs run at once; the work
is about 2 + Dk / Dv = 3 sequential scans. Checkpoints at any chunk boundary come from pass 3
(its carried float32 state); those on segment boundaries are pass 2's composed states.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import scan_fused
from kernels_pallas.gated_delta.dots import dot as _dot, dot_t as _dot_t


def _maps_kernel(w_ref, u_ref, kd_ref, dl_ref, out_ref, *, n_chunks, chunk, dot_dtype, nbv,
                 block_v):
    # w/kd [Ls, Dk]; u [Ls, BV] (rows of N_g: real values; rows of M_g: multiplied by 0);
    # dl [L]; out [BV, Dk] rows j*BV.. of [N_g; M_g] ([Dv + Dk, Dk])
    j = pl.program_id(2)
    is_b = (j < nbv).astype(jnp.float32)
    dk = w_ref.shape[-1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (block_v, dk), 0) + (j - nbv) * block_v
    cols = jax.lax.broadcasted_iota(jnp.int32, (block_v, dk), 1)
    s = jnp.where(rows == cols, 1.0 - is_b, 0.0).astype(jnp.float32)  # [0 | I] rows

    def body(c, s):
        r = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        v_t = u_ref[r, :].astype(jnp.float32).T * is_b - _dot_t(s, w_ref[r, :], dot_dtype)
        return s * dl_ref[c] + _dot(v_t, kd_ref[r, :], dot_dtype)

    out_ref[...] = jax.lax.fori_loop(0, n_chunks, body, s)


def _specs(segs, seg_t, seg_c):
    """BlockSpecs on the [N, T, Hv, D] inputs for a grid over (N G, Hv, j)."""
    def seq(d, col=lambda j: 0):
        return pl.BlockSpec((None, seg_t, None, d),
                            lambda b, h, j: (b // segs, b % segs, h, col(j)))
    dl = pl.BlockSpec((None, None, seg_c), lambda b, h, j: (b // segs, h, b % segs))
    return seq, dl


def segment_maps(w, u, kd, dl, segs, *, chunk, block_v=16, dot_dtype=None, num_warps=4,
                 num_stages=3, interpret=False):
    """Pass 1: [N, G, Hv, Dv + Dk, Dk] float32, rows :Dv = N_g (from zero), Dv: = M_g."""
    n, t_len, hv, dk = w.shape
    dv = u.shape[-1]
    nbv = dv // block_v
    seg_t, seg_c = t_len // segs, t_len // segs // chunk
    seq, dl_spec = _specs(segs, seg_t, seg_c)
    out_spec = pl.BlockSpec((None, None, None, block_v, dk),
                            lambda b, h, j: (b // segs, b % segs, h, j, 0))
    return pl.pallas_call(
        functools.partial(_maps_kernel, n_chunks=seg_c, chunk=chunk, dot_dtype=dot_dtype or w.dtype,
                          nbv=nbv, block_v=block_v),
        grid=(n * segs, hv, (dv + dk) // block_v),
        in_specs=[seq(dk), seq(block_v, lambda j: jnp.minimum(j, nbv - 1)), seq(dk), dl_spec],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((n, segs, hv, dv + dk, dk), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(w, u, kd, dl.astype(jnp.float32))


def compose(maps, state0, dv, *, precision=None, transition=False):
    """Pass 2 in XLA (one small matmul per segment, unrolled): entering states
    [N, G, Hv, Dv, Dk] (R = S^T) of every segment and, with transition, the whole product
    M_0 .. M_{G-1} [N, Hv, Dk, Dk] (R layout)."""
    mm = functools.partial(jnp.einsum, "nhij,nhjk->nhik", precision=precision)
    r = jnp.swapaxes(state0.astype(jnp.float32), -1, -2)
    p, entering = None, []
    for g in range(maps.shape[1]):
        entering.append(r)
        r = mm(r, maps[:, g, :, dv:]) + maps[:, g, :, :dv]
        if transition:
            p = maps[:, g, :, dv:] if p is None else mm(p, maps[:, g, :, dv:])
    return jnp.stack(entering, axis=1), p


def _compose_kernel(maps_ref, s0_ref, ent_ref, *, segs, dv, nbv, block_v):
    # maps [G, Dv + Dk, Dk] of one (sequence, head); s0 [BV, Dk] rows of R0 = S0^T;
    # ent [G + 1, BV, Dk]: rows j*BV.. of [R; P] entering each segment, then the final ones
    j = pl.program_id(2)
    is_b = (j < nbv).astype(jnp.float32)
    dk = maps_ref.shape[-1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (block_v, dk), 0) + (j - nbv) * block_v
    cols = jax.lax.broadcasted_iota(jnp.int32, (block_v, dk), 1)
    r = s0_ref[...] * is_b + jnp.where(rows == cols, 1.0 - is_b, 0.0)
    first = jnp.minimum(j, nbv - 1) * block_v

    def body(g, r):
        ent_ref[g] = r
        n_g = maps_ref[g, pl.ds(first, block_v), :]
        return _dot(r, maps_ref[g, pl.ds(dv, dk), :], jnp.float32) + n_g * is_b

    ent_ref[segs] = jax.lax.fori_loop(0, segs, body, r)


def compose_pallas(maps, state0, dv, *, transition=False, block_v=16, num_warps=8,
                   interpret=False):
    """Pass 2 as one Pallas kernel, grid (N, Hv, rows / BV), IEEE float32 dots; rows of P (the
    transition) only with transition. Same results as `compose`."""
    n, segs, hv, rows, dk = maps.shape
    nbv = dv // block_v
    r0 = jnp.swapaxes(state0.astype(jnp.float32), -1, -2)  # [N, Hv, Dv, Dk]
    ent = pl.pallas_call(
        functools.partial(_compose_kernel, segs=segs, dv=dv, nbv=nbv, block_v=block_v),
        grid=(n, hv, (rows if transition else dv) // block_v),
        in_specs=[pl.BlockSpec((None, segs, None, rows, dk), lambda b, h, j: (b, 0, h, 0, 0)),
                  pl.BlockSpec((None, None, block_v, dk),
                               lambda b, h, j: (b, h, jnp.minimum(j, nbv - 1), 0))],
        out_specs=pl.BlockSpec((None, segs + 1, None, block_v, dk),
                               lambda b, h, j: (b, 0, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct((n, segs + 1, hv, rows, dk), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(maps, r0)
    return ent[:, :segs], (ent[:, segs, :, dv:] if transition else None)


def _scan_kernel(w_ref, u_ref, kd_ref, dl_ref, s0_ref, *refs, n_chunks, chunk, dot_dtype,
                 n_ckpt):
    # as scan_fused._scan_kernel ("vk" layout) over one segment; checkpoints: bnd/order/valid
    # [M] (local sorted boundaries clipped to [0, L], their checkpoint index, whether the
    # boundary is this segment's), ckpt [M, Dk, BV] (only valid slots written)
    if n_ckpt:
        bnd_ref, order_ref, valid_ref, vnew_ref, states_ref, final_ref, ckpt_ref = refs
    else:
        vnew_ref, states_ref, final_ref = refs

    def body(c, s):
        states_ref[c] = s.astype(states_ref.dtype)
        return scan_fused.step(c, s, w_ref, u_ref, kd_ref, dl_ref, vnew_ref, chunk=chunk,
                               dot_dtype=dot_dtype, layout="vk")

    s, start = s0_ref[...].astype(jnp.float32), 0
    if n_ckpt:
        def segment(p, carry):
            s, start = carry
            end = bnd_ref[p]
            s = jax.lax.fori_loop(start, end, body, s)

            @pl.when(valid_ref[p] > 0)
            def _():
                ckpt_ref[order_ref[p]] = s.T
            return s, end
        s, start = jax.lax.fori_loop(0, n_ckpt, segment, (s, jnp.int32(0)))
    final_ref[...] = jax.lax.fori_loop(start, n_chunks, body, s)


def _checkpoint_operands(ckpt_idx, segs, seg_c):
    """Per segment (rows N G): the sorted boundaries local to it clipped to [0, L], their
    checkpoint index, and whether the boundary is the segment's own (the last segment also owns
    the final boundary NT)."""
    n, m = ckpt_idx.shape
    nt = segs * seg_c
    idx = jnp.clip(ckpt_idx.astype(jnp.int32), 0, nt)
    order = jnp.argsort(idx, axis=1).astype(jnp.int32)
    local = (jnp.take_along_axis(idx, order, axis=1)[:, None, :]
             - seg_c * jnp.arange(segs, dtype=jnp.int32)[None, :, None])  # [N, G, M]
    last = jnp.arange(segs)[None, :, None] == segs - 1
    valid = ((local >= 0) & (local < seg_c)) | (last & (local == seg_c))
    flat = lambda x: x.reshape(n * segs, m).astype(jnp.int32)  # noqa: E731
    return [flat(jnp.clip(local, 0, seg_c)), flat(jnp.broadcast_to(order[:, None], local.shape)),
            flat(valid)], jnp.minimum(idx // seg_c, segs - 1)


def segment_scan(w, u, kd, dl, entering, ckpt_idx, segs, *, chunk, block_v=16, dot_dtype=None,
                 num_warps=4, num_stages=3, interpret=False):
    """Pass 3: every segment from its entering state. Returns V' [N, T, Hv, Dv], the states
    entering each chunk [N, Hv, NT, Dv, Dk] (dot dtype), the final state [N, Hv, Dk, Dv] f32 and
    checkpoints [N, M, Hv, Dk, Dv] f32 (None without ckpt_idx)."""
    n, t_len, hv, dk = w.shape
    dv = u.shape[-1]
    seg_t, seg_c = t_len // segs, t_len // segs // chunk
    dot_dtype = dot_dtype or w.dtype
    seq, dl_spec = _specs(segs, seg_t, seg_c)
    per_seg = pl.BlockSpec((None, None, None, block_v, dk),
                           lambda b, h, j: (b // segs, b % segs, h, j, 0))
    in_specs = [seq(dk), seq(block_v, lambda j: j), seq(dk), dl_spec, per_seg]
    args = [w, u, kd, dl.astype(jnp.float32), entering]
    out_specs = [seq(block_v, lambda j: j),
                 pl.BlockSpec((None, None, seg_c, block_v, dk),
                              lambda b, h, j: (b // segs, h, b % segs, j, 0)), per_seg]
    out_shape = [jax.ShapeDtypeStruct((n, t_len, hv, dv), dot_dtype),
                 jax.ShapeDtypeStruct((n, hv, segs * seg_c, dv, dk), dot_dtype),
                 jax.ShapeDtypeStruct((n, segs, hv, dv, dk), jnp.float32)]
    n_ckpt = 0 if ckpt_idx is None else ckpt_idx.shape[1]
    if n_ckpt:
        extra, seg_of = _checkpoint_operands(ckpt_idx, segs, seg_c)
        in_specs += [pl.BlockSpec((None, n_ckpt), lambda b, h, j: (b, 0))] * 3
        args += extra
        out_specs.append(pl.BlockSpec((None, None, n_ckpt, None, dk, block_v),
                                      lambda b, h, j: (b // segs, b % segs, 0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((n, segs, n_ckpt, hv, dk, dv), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_scan_kernel, n_chunks=seg_c, chunk=chunk, dot_dtype=dot_dtype,
                          n_ckpt=n_ckpt),
        grid=(n * segs, hv, dv // block_v),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*args)
    final = jnp.swapaxes(outs[2][:, -1], -1, -2)
    ckpt = None
    if n_ckpt:  # each checkpoint from the segment that owns its boundary
        ckpt = jnp.take_along_axis(outs[3], seg_of[:, None, :, None, None, None], axis=1)[:, 0]
    return outs[0], outs[1], final, ckpt


def num_segments(n_chunks, segments):
    """The segment count used: the largest power of two <= `segments` dividing n_chunks."""
    if segments < 1:
        raise ValueError(f"gated_delta blocked scan: segments must be >= 1, got {segments}")
    g = 1
    while g * 2 <= segments and n_chunks % (g * 2) == 0:
        g *= 2
    return g


def blocked_gated_delta(q, k, v, g, beta, state0, ckpt_idx=None, *, scale, chunk=64,
                        segments=16, dot_dtype=None, interpret=False, transition=False,
                        block_v=16, num_warps=4, num_stages=3, compose_impl="pallas"):
    """fused_triton.fused_gated_delta with the two-level scan (module doc) in place of the
    sequential one: the Pallas intra-chunk solve, passes 1-3, the Pallas output kernel.
    compose_impl: pass 2 as one Pallas kernel ("pallas") or unrolled XLA matmuls ("xla").
    Returns out [N, T, Hv, Dv] (v's dtype), final [N, Hv, Dk, Dv] f32, checkpoints
    [N, M, Hv, Dk, Dv] f32 or None, and with transition a_span [N, Hv, Dk, Dk] f32."""
    from kernels_pallas.gated_delta import dots, fused_triton
    n, t_len, _, dk = k.shape
    dv = v.shape[-1]
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    segs = num_segments(t_len // chunk, segments)
    w, u, kd, gc = fused_triton.intra(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                      interpret=interpret, kind=fused_triton.DEFAULTS["intra"],
                                      num_warps=fused_triton.DEFAULTS["intra_warps"])
    dl = jnp.moveaxis(jnp.exp(gc[:, chunk - 1::chunk, :]), 1, 2)  # [N, Hv, NT]
    opts = dict(chunk=chunk, block_v=min(block_v, dv), dot_dtype=dot_dtype, num_warps=num_warps,
                num_stages=num_stages, interpret=interpret)
    maps = segment_maps(w, u, kd, dl, segs, **opts)
    if compose_impl == "pallas":
        entering, prod = compose_pallas(maps, state0, dv, transition=transition,
                                        block_v=opts["block_v"], interpret=interpret)
    else:
        entering, prod = compose(maps, state0, dv, precision=dots._prec(dot_dtype),
                                 transition=transition)
    v_new, states, final, ckpt = segment_scan(w, u, kd, dl, entering, ckpt_idx, segs, **opts)
    out = fused_triton.output_fused(q, k, g, v_new, states, scale=scale, chunk=chunk,
                                    dot_dtype=dot_dtype, out_dtype=v.dtype, interpret=interpret,
                                    num_warps=fused_triton.DEFAULTS["out_warps"], states_t=True)
    return (out, final, ckpt) + ((jnp.swapaxes(prod, -1, -2),) if transition else ())
