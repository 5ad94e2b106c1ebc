"""Chunked gated delta rule as three Pallas (Triton backend) kernels, no XLA transposes.

All tensors stay in the caller's [N, T, H, D] layout (BlockSpecs squeeze the head axis):
  1. intra-chunk UT solve, grid (N, NT, Hv): gc = cumsum(g); A = tril(beta K K^T Gamma, -1);
     W = (I + A)^-1 (beta exp(gc) K), U = (I + A)^-1 (beta V), KD = K exp(gc_last - gc), every
     exponent gc_i - gc_j summed directly as g over (j, i] (`chunked.segment_sums`; the blocked
     solve and kernel 3 do so for float32 dots only, `dots.is_exact`). Either
     in 16-row sub-blocks (intra_blocked.py, default) or by C row-substitution steps over the
     whole [C, C] tile (`_intra_kernel` below; exact formula, no series).
  2. state scan, grid (N, Hv, Dv / BV) (scan_fused.py): the float32 state walks the chunks in
     registers, writes the state entering each chunk (dot dtype, for 3), V' = U - W S, and
     float32 checkpoints at the boundaries asked for.
  3. `_output_kernel`, grid (N, NT, Hv): O = (scale Q exp(gc)) S + tril(scale Q K^T Gamma) V'.
Value head h reads key head h // (Hv // Hk) (GVA). T must be a multiple of C (api.py pads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import intra_blocked, scan_fused, stream_rows
from kernels_pallas.gated_delta.chunked import segment_sums
from kernels_pallas.gated_delta.dots import chunks_below, is_exact
from kernels_pallas.gated_delta.dots import dot as _dot, dot_t as _dot_t


def _intra_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gc_ref, *, chunk,
                  dot_dtype):
    # k_ref [C, Dk], v_ref [C, Dv], g_ref/beta_ref [C]; outputs w/kd [C, Dk], u [C, Dv], gc [C]
    k = k_ref[...].astype(jnp.float32)
    beta = beta_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    gc = jnp.cumsum(g)
    seg = segment_sums(g)  # [C, C]: g summed over (j, i]
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    gamma = jnp.exp(jnp.where(rows > cols, seg, -jnp.inf))  # strictly lower, 0 elsewhere
    a = _dot_t(k * beta[:, None], k, dot_dtype) * gamma  # [C, C]
    eye = (rows == cols).astype(jnp.float32)

    def substitute(i, x):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # row i of A, [C]
        x_i = -jnp.sum(a_i[:, None] * x, axis=0)  # -(A_i X), uses rows < i only
        return jnp.where(rows == i, x_i[None, :] + eye, x)

    x = jax.lax.fori_loop(1, chunk, substitute, eye)  # (I + A)^-1
    u_ref[...] = _dot(x, v_ref[...].astype(jnp.float32) * beta[:, None], dot_dtype
                      ).astype(u_ref.dtype)
    w_ref[...] = _dot(x, k * (beta * jnp.exp(gc))[:, None], dot_dtype).astype(w_ref.dtype)
    to_end = jnp.sum(jnp.where(rows == chunk - 1, seg, 0.0), axis=0)  # g over (j, C - 1]
    kd_ref[...] = (k * jnp.exp(to_end)[:, None]).astype(kd_ref.dtype)
    gc_ref[...] = gc


def _output_kernel(q_ref, k_ref, g_ref, vnew_ref, s_ref, o_ref, *, chunk, scale, dot_dtype,
                   states_t):
    # q/k [C, Dk]; g [C] float32; vnew [C, Dv]; s [Dk, Dv] ([Dv, Dk] if states_t); o [C, Dv]
    g = g_ref[...]
    gc = jnp.cumsum(g)
    q = q_ref[...].astype(jnp.float32) * scale
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    # float32: exponents summed directly (exact to a few ulps of each segment); bf16 / f16 dots
    # keep the difference of cumsums (its ~eps32 * |gc| exponent error is far below their
    # rounding, and the [C, C] segment sums are a measurable share of a long prefill on the H200:
    # benchmarks/RESULTS.md, Gated DeltaNet)
    seg = segment_sums(g) if is_exact(dot_dtype) else gc[:, None] - gc[None, :]
    gamma = jnp.exp(jnp.where(rows >= cols, seg, -jnp.inf))
    attn = _dot_t(q, k_ref[...], dot_dtype) * gamma  # [C, C]
    qg = q * jnp.exp(gc)[:, None]
    inter = _dot_t(qg, s_ref[...], dot_dtype) if states_t else _dot(qg, s_ref[...], dot_dtype)
    o = inter + _dot(attn, vnew_ref[...], dot_dtype)
    o_ref[...] = o.astype(o_ref.dtype)


def _specs(chunk, rep):
    def tok(d, heads_from_v=True):  # [C, d] block of head h of chunk c, layout [N, T, H, d]
        if heads_from_v:
            return pl.BlockSpec((None, chunk, None, d), lambda b, c, h: (b, c, h, 0))
        return pl.BlockSpec((None, chunk, None, d), lambda b, c, h: (b, c, h // rep, 0))
    return tok, pl.BlockSpec((None, chunk, None), lambda b, c, h: (b, c, h))


def intra_chunk_fused(k, v, g, beta, *, chunk=64, dot_dtype=None, interpret=False, num_warps=4,
                      used=None):
    """Kernel 1 by row substitution: (w, u, kd [N, T, Hv, D] in dot_dtype, gc [N, T, Hv] f32);
    used: None or an int32 scalar, only chunks below it (dots.chunks_below)."""
    n, t_len, hk, dk = k.shape
    hv, dv = v.shape[2:]
    nt = t_len // chunk
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    tok, gate_spec = _specs(chunk, hv // hk)
    kernel, used_spec, used_arg = chunks_below(functools.partial(
        _intra_kernel, chunk=chunk, dot_dtype=dot_dtype), 4, used, nt)
    return pl.pallas_call(
        kernel,
        grid=(n, nt, hv),
        in_specs=[tok(dk, False), tok(dv), gate_spec, gate_spec] + used_spec,
        out_specs=[tok(dk), tok(dv), tok(dk), gate_spec],
        out_shape=[jax.ShapeDtypeStruct((n, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv, dv), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv, dk), dot_dtype),
                   jax.ShapeDtypeStruct((n, t_len, hv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(k, v, g.astype(jnp.float32), beta, *used_arg)


def output_fused(q, k, g, v_new, states, *, scale, chunk, dot_dtype, out_dtype, interpret=False,
                 num_warps=4, states_t=False, used=None, src=None):
    """Kernel 3 alone: O [N, T, Hv, Dv] from q/k [N, T, Hk, Dk], the gates g [N, T, Hv] (the
    kernel sums them itself: `chunked.segment_sums`), V' and the states entering each chunk,
    [N, Hv, NT, Dk, Dv] ([N, Hv, NT, Dv, Dk] if states_t); used: None or an int32 scalar, only
    chunks below it (dots.chunks_below); src: None or [T] int32: q, k, g are a ragged step's
    source rows ([R, Hk, Dk], [R, Hv]; N = 1) read through it (stream_rows.py)."""
    hv, dv = v_new.shape[2:]
    hk, dk = k.shape[-2:]
    n, t_len = v_new.shape[:2]
    tok, gate_spec = _specs(chunk, hv // hk)
    sb = (dv, dk) if states_t else (dk, dv)
    kernel, used_spec, used_arg = chunks_below(functools.partial(
        _output_kernel, chunk=chunk, scale=scale, dot_dtype=dot_dtype, states_t=states_t), 5,
        used, t_len // chunk)
    ins = [q, k, g.astype(jnp.float32)]
    in_specs = [tok(dk, False), tok(dk, False), gate_spec]
    srcs = []
    if src is not None:  # q, k, g through the source rows; v_new and the states as packed
        rows, rep = q.shape[0], hv // hk
        ins = [stream_rows.flat_source(x) for x in ins]
        in_specs = [stream_rows.whole(x) for x in ins]
        kernel = stream_rows.through_rows(kernel, [(0, hk, rep, rows), (0, hk, rep, rows),
                                                   (0, hv, 1, rows), None, None],
                                          len(used_arg), chunk)
        srcs = [src]
    return pl.pallas_call(
        kernel,
        grid=(n, t_len // chunk, hv),
        in_specs=in_specs + [tok(dv),
                             pl.BlockSpec((None, None, None, *sb), lambda b, c, h: (b, h, c, 0, 0))]
        + used_spec + [stream_rows.whole(x) for x in srcs],
        out_specs=tok(dv),
        out_shape=jax.ShapeDtypeStruct((n, t_len, hv, dv), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(*ins, v_new, states, *used_arg, *srcs)


def intra(k, v, g, beta, *, chunk, dot_dtype, interpret, kind="blocked", num_warps=4, used=None,
          src=None):
    """Kernel 1, "blocked" (intra_blocked.py), "subst" (`intra_chunk_fused`) or "mosaic"
    (intra_mosaic.py: Mosaic GPU, bf16 / f16, chunk 64); src: (src, src_v) for "blocked" only
    (intra_chunk_blocked)."""
    if src is not None and kind != "blocked":
        raise ValueError(f"gated_delta fused: source rows (src) need intra 'blocked', got {kind!r}")
    if kind == "mosaic":
        from kernels_pallas.gated_delta import intra_mosaic
        return intra_mosaic.intra_chunk_mosaic(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                               interpret=interpret, used=used)
    if kind == "blocked":
        return intra_blocked.intra_chunk_blocked(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                                 interpret=interpret, num_warps=num_warps,
                                                 used=used, src=src)
    if kind == "subst":
        return intra_chunk_fused(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype,
                                 interpret=interpret, num_warps=num_warps, used=used)
    raise ValueError(f"gated_delta fused: intra must be 'blocked', 'subst' or 'mosaic', "
                     f"got {kind!r}")


# fastest correct options of the H200 sweep (benchmarks/RESULTS.md, Gated DeltaNet)
DEFAULTS = dict(intra="blocked", intra_warps=2, layout="vk", block_v=16, scan_warps=4,
                scan_stages=3, ckpt_store="segments", out_warps=4, output="triton")


def fused_gated_delta(q, k, v, g, beta, state0, ckpt_idx=None, *, scale, chunk=64,
                      dot_dtype=None, interpret=False, **options):
    """Chunked gated delta rule; same contract as `chunked.chunked_gated_delta` (T % chunk == 0).

    dot_dtype: matmul operand dtype (default: v's dtype; bf16 inputs -> bf16 MMAs, fp32 acc).
    Intermediates (W, U, KD, V', per-chunk states) are stored in dot_dtype; the carried state,
    the final state and the checkpoints are float32 (checkpoints are the carried state itself).
    options (defaults in DEFAULTS): intra "blocked" (intra_blocked.py), "subst" (row
    substitution above) or "mosaic" (intra_mosaic.py), intra_warps; the scan's layout ("kv" / "vk"), block_v, scan_warps,
    scan_stages, ckpt_store (scan_fused.py); out_warps for the output kernel, output "triton"
    (`output_fused`) or "mosaic" (output_mosaic.py; bf16 / f16).
    """
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"gated_delta fused_gated_delta: unknown options {sorted(unknown)}; "
                         f"known: {sorted(DEFAULTS)}")
    opt = {**DEFAULTS, **options}
    dot_dtype = v.dtype if dot_dtype is None else dot_dtype
    w, u, kd, gc = intra(k, v, g, beta, chunk=chunk, dot_dtype=dot_dtype, interpret=interpret,
                         kind=opt["intra"], num_warps=opt["intra_warps"])
    dl = jnp.moveaxis(jnp.exp(gc[:, chunk - 1::chunk, :]), 1, 2)  # [N, Hv, NT]
    v_new, states, final, ckpt_states = scan_fused.state_scan(
        w, u, kd, dl, state0.astype(jnp.float32), ckpt_idx, chunk=chunk,
        block_v=opt["block_v"], layout=opt["layout"], ckpt_store=opt["ckpt_store"],
        dot_dtype=dot_dtype, num_warps=opt["scan_warps"], num_stages=opt["scan_stages"],
        interpret=interpret)
    if opt["output"] == "mosaic":
        from kernels_pallas.gated_delta import output_mosaic
        out = output_mosaic.output_mosaic(q, k, g, v_new, states, scale=scale, chunk=chunk,
                                          states_t=opt["layout"] == "vk", interpret=interpret)
        return out.astype(v.dtype), final, ckpt_states
    out = output_fused(q, k, g, v_new, states, scale=scale, chunk=chunk, dot_dtype=dot_dtype,
                       out_dtype=v.dtype, interpret=interpret, num_warps=opt["out_warps"],
                       states_t=opt["layout"] == "vk")
    return out, final, ckpt_states
