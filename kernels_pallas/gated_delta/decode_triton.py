"""One decode step of the gated delta rule in place in the state cache, Pallas (Triton lowering).

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

`decode_layer_in_place` also takes the layer's glue into the kernel (one program per row and
value head, the whole head): the q / k l2 norms, the gates beta = sigmoid(b) and g = -exp(a_log)
softplus(a + dt_bias), and the gated RMS norm of the output, each cast where the XLA layer
casts (qwen3_5_gdn.GatedDeltaNet), so a decode step's GDN layer is its projections, the conv and
this one kernel.

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


def _step(s0, k, v, g, beta, has):
    """The state after one token, [Dk, BV]: exp(g) s0 + k (beta (v - (exp(g) s0)^T k))^T; s0
    itself where `has` is False (decay 1, write 0: s0 + 0, so no second tile stays live for a
    final select)."""
    s = s0 * jnp.where(has, jnp.exp(g), 1.0)
    kv = jnp.sum(k[:, None] * s, axis=0)  # [BV]
    return s + k[:, None] * ((v - kv) * jnp.where(has, beta, 0.0))[None, :]


def _kernel(slot_ref, keep_ref, has_ref, *refs, rep, scale, block_v, indexed):
    # slot / keep / has [N] int32; with `indexed` row [N] int32 next (row n's inputs are row
    # row[n] of q, k, v, g, beta: [T, ...]); q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv];
    # state [P, Hv, Dk, Dv] float32 (the cache, aliased to state_out); o [N, Hv, Dv] float32
    row_ref, refs = (refs[0], refs[1:]) if indexed else (None, refs)
    q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, state_out_ref = refs
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
    has = has_ref[n] != 0

    def step():
        slot, kh = slot_ref[n], h // rep
        r = n if row_ref is None else row_ref[n]
        s0 = jnp.where(keep_ref[n] != 0, state_ref[slot, h, :, cols], 0.0)  # [Dk, BV]
        q = q_ref[r, kh, :].astype(_F32) * scale  # [Dk]
        k = k_ref[r, kh, :].astype(_F32)
        v = v_ref[r, h, cols].astype(_F32)  # [BV]
        s = _step(s0, k, v, g_ref[r, h].astype(_F32), beta_ref[r, h].astype(_F32), has)
        o_ref[n, h, cols] = jnp.where(has, jnp.sum(q[:, None] * s, axis=0), 0.0)
        state_out_ref[slot, h, :, cols] = s

    if row_ref is None:
        step()
        return
    # indexed (a prefill step's one-row sequences): a sequence it does not step and keeps
    # (the chunked pass's) is left alone, its state neither read nor written back
    pl.when(has | (keep_ref[n] == 0))(step)

    @pl.when(~has & (keep_ref[n] != 0))
    def _():
        o_ref[n, h, cols] = jnp.zeros((block_v,), _F32)


def sigmoid_in(x, dtype):
    """jax.nn.sigmoid(x) for x of `dtype` as JAX computes it, 1 / (1 + exp(-x)) rounded to
    `dtype` after each op (one rounding of the float32 value differs in 1 of 3 bf16 values by
    a unit in the last place), returned as float32."""
    def r(y):
        return y.astype(dtype).astype(_F32)
    e = r(jnp.exp(-x.astype(_F32)))
    return r(1.0 / r(e + 1.0))


def _conv_silu(x_ref, w_ref, c_ref, c_out_ref, n, slot, keep, has, c0, width, dtype):
    """Channels [c0, c0 + width) of a row's causal conv (qwen3_5_gdn.causal_conv at one token:
    the Kc - 1 inputs of the conv state, oldest first, zeros where not kept, then the new
    input x; float32 products summed oldest first, silu, cast to `dtype`) as float32, and the
    conv state moved on by the row's input where it has one, written back in place."""
    chans = pl.ds(c0, width)
    kc, c_dtype = w_ref.shape[1], c_ref.dtype
    past = [jnp.where(keep, c_ref[slot, chans, j], 0).astype(c_dtype) for j in range(kc - 1)]
    window = [p.astype(x_ref.dtype) for p in past] + [x_ref[n, chans]]
    acc = window[0].astype(_F32) * w_ref[chans, 0].astype(_F32)
    for j in range(1, kc):
        acc = acc + window[j].astype(_F32) * w_ref[chans, j].astype(_F32)
    for j in range(kc - 1):
        c_out_ref[slot, chans, j] = jnp.where(has, window[j + 1].astype(c_dtype), past[j])
    return jax.nn.silu(acc).astype(dtype).astype(_F32)


def _layer_kernel(*refs, rep, hk, scale, eps, qk_eps, conv, proj_cols=None):
    # _kernel's step over a whole head (Dv), with the layer's glue around it, each value cast as
    # the XLA layer casts it (qwen3_5_gdn.GatedDeltaNet): q / k l2-normed in float32; beta =
    # sigmoid(b) in the model dtype, op by op (sigmoid_in); g = -exp(a_log) softplus(a +
    # dt_bias) in float32; the output in the model dtype, RMS-normed over Dv, times `norm` (in
    # the model dtype), times silu(z) in float32. a, b [N, Hv]; a_log, dt_bias [Hv]; z [N, Hv,
    # Dv]; norm [Dv]; o [N, Hv, Dv] in the model dtype. With `conv`, q / k / v come from the
    # causal conv of the mixed projection x [N, C] (_conv_silu; conv_w [C, Kc], the conv cache
    # [P, C, Kc - 1] aliased in and out), else q, k [N, Hk, Dk] and v [N, Hv, Dv] are given.
    # With proj_cols (z0, b0, a0) a, b, z are read from the layer's projection [N, W] itself,
    # row n's columns z0 + h Dv.., b0 + h, a0 + h (no [N, ...] slices made for the call).
    if conv:
        (slot_ref, keep_ref, has_ref, x_ref, w_ref, a_ref, b_ref, a_log_ref, dt_bias_ref, z_ref,
         norm_ref, c_ref, state_ref, o_ref, c_out_ref, state_out_ref) = refs
    elif proj_cols is not None:
        (slot_ref, keep_ref, has_ref, q_ref, k_ref, v_ref, proj_ref, a_log_ref, dt_bias_ref,
         norm_ref, state_ref, o_ref, state_out_ref) = refs
    else:
        (slot_ref, keep_ref, has_ref, q_ref, k_ref, v_ref, a_ref, b_ref, a_log_ref, dt_bias_ref,
         z_ref, norm_ref, state_ref, o_ref, state_out_ref) = refs
    n, h = pl.program_id(0), pl.program_id(1)
    _, _, dk, dv = state_ref.shape
    if proj_cols is not None:
        z0, b0, a0 = proj_cols
        a_in, b_in = proj_ref[n, a0 + h], proj_ref[n, b0 + h]
        z_start = z0 + h * dv
        z_in = proj_ref[n, pl.ds(pl.multiple_of(z_start, dv) if z0 % dv == 0 else z_start, dv)]
    else:
        a_in, b_in, z_in = a_ref[n, h], b_ref[n, h], z_ref[n, h, :]
    slot, kh, dtype = slot_ref[n], h // rep, z_in.dtype
    keep, has = keep_ref[n] != 0, has_ref[n] != 0
    s0 = jnp.where(keep, state_ref[slot, h, :, :], 0.0)  # [Dk, Dv]
    if conv:  # channels [q | k | v]; rep == 1: each program owns its head's channels
        qkv = [_conv_silu(x_ref, w_ref, c_ref, c_out_ref, n, slot, keep, has, c0, width, dtype)
               for c0, width in ((kh * dk, dk), ((hk + kh) * dk, dk), (2 * hk * dk + h * dv, dv))]
    else:
        qkv = [q_ref[n, kh, :], k_ref[n, kh, :], v_ref[n, h, :]]
    q, k, v = (x.astype(_F32) for x in qkv)

    def l2norm(x):
        return x * jax.lax.rsqrt(jnp.sum(x * x) + qk_eps)
    q, k = l2norm(q) * scale, l2norm(k)  # [Dk]
    beta = sigmoid_in(b_in, dtype)
    g = -jnp.exp(a_log_ref[h].astype(_F32)) * jax.nn.softplus(
        a_in.astype(_F32) + dt_bias_ref[h].astype(_F32))
    s = _step(s0, k, v, g, beta, has)
    core = jnp.where(has, jnp.sum(q[:, None] * s, axis=0), 0.0).astype(dtype).astype(_F32)
    normed = (core * jax.lax.rsqrt(jnp.mean(core * core) + eps)).astype(dtype)
    out = (norm_ref[...] * normed).astype(_F32) * jax.nn.silu(z_in.astype(_F32))
    o_ref[n, h, :] = out.astype(dtype)
    state_out_ref[slot, h, :, :] = s


def _check_layer(name, rows, hv, dv, a, b, z, state):
    if z.shape != (rows, hv, dv) or a.shape != (rows, hv) or b.shape != a.shape:
        raise ValueError(f"{name}: z {z.shape}, a {a.shape}, b {b.shape} do not fit {rows} rows "
                         f"and the state cache {state.shape}")
    _check_state(name, state)


def _check_state(name, state):
    if state.dtype != _F32:
        raise ValueError(f"{name}: the state cache must be float32, got {state.dtype}")


def _layer_call(args, aliased, out_dtype, grid, kernel, num_warps, interpret, name):
    """pallas_call of _layer_kernel: `args` with the aliased caches last (`aliased` of them),
    outputs the layer's output [N, Hv, Dv] then those caches."""
    rows, hv = grid
    dv = args[-1].shape[-1]
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    out = jax.ShapeDtypeStruct((rows, hv, dv), out_dtype)
    caches = args[len(args) - aliased:]
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[whole(x) for x in args],
        out_specs=[whole(out)] + [whole(c) for c in caches],
        out_shape=[out] + [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={len(args) - aliased + i: 1 + i for i in range(aliased)},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(*args)


def _row_flags(slots, keep, has, slots_n):
    return [jnp.clip(jnp.asarray(slots, jnp.int32), 0, slots_n - 1),
            *(jnp.asarray(x).astype(jnp.int32) for x in (keep, has))]


def decode_layer_in_place(q, k, v, a, b, a_log, dt_bias, z, norm, state, slots, keep, has, *,
                          eps: float, qk_eps: float = 1e-6, scale=None, num_warps: int = 8,
                          interpret: bool = False, proj=None):
    """`decode_in_place` with the GDN layer's glue fused around the step (one program per row
    and value head, the whole head): q / k [N, Hk, Dk] before their l2 norm (qk_eps), the
    gates' inputs a, b [N, Hv] with a_log, dt_bias [Hv], and the gated RMS norm's z [N, Hv, Dv],
    weight norm [Dv] and eps. proj: None, or (x, z_col) with a, b, z None: they are columns of
    the layer's fused projection x [N', W] (N' >= N rows, row n is row n), z [Hv Dv] from
    z_col, then b [Hv], then a [Hv] (Qwen3.5's [w_qkv | w_z | w_b | w_a]), read by the kernel
    there: on a GPU each sliced operand was a copy kernel of its own (3 a GDN layer, session
    30). Returns (the normed gated output [N, Hv, Dv] in z's dtype, zeros where has is False,
    and the updated cache)."""
    rows, hk, dk = k.shape
    slots_n, hv, dk_s, dv = state.shape
    if q.shape != k.shape or v.shape != (rows, hv, dv) or dk_s != dk or hv % hk:
        raise ValueError(f"decode_layer_in_place: q {q.shape}, k {k.shape}, v {v.shape} do not "
                         f"fit the state cache {state.shape}")
    kernel = functools.partial(_layer_kernel, rep=hv // hk, hk=hk, eps=float(eps),
                               scale=float(dk ** -0.5 if scale is None else scale),
                               qk_eps=float(qk_eps), conv=False)
    flags = _row_flags(slots, keep, has, slots_n)
    if proj is None:
        _check_layer("decode_layer_in_place", rows, hv, dv, a, b, z, state)
        args, out_dtype = [*flags, q, k, v, a, b, a_log, dt_bias, z, norm, state], z.dtype
    else:
        x, z_col = proj
        if a is not None or b is not None or z is not None:
            raise ValueError("decode_layer_in_place: give a, b, z or proj, not both")
        if x.ndim != 2 or x.shape[0] < rows or z_col + hv * dv + 2 * hv > x.shape[1]:
            raise ValueError(f"decode_layer_in_place: proj {x.shape} holds no z, b, a of "
                             f"{hv} heads x {dv} from column {z_col} for {rows} rows")
        _check_state("decode_layer_in_place", state)
        kernel = functools.partial(kernel, proj_cols=(z_col, z_col + hv * dv,
                                                      z_col + hv * dv + hv))
        args, out_dtype = [*flags, q, k, v, x, a_log, dt_bias, norm, state], x.dtype
    return _layer_call(args, 1, out_dtype, (rows, hv), kernel, num_warps, interpret,
                       "gdn_decode_layer_in_place")


def decode_conv_layer_in_place(x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm, state,
                               slots, keep, has, *, eps: float, qk_eps: float = 1e-6,
                               scale=None, num_warps: int = 8, interpret: bool = False):
    """`decode_layer_in_place` with the layer's causal conv too: x [N, C] the mixed projection
    (C = 2 Hk Dk + Hv Dv, channels [q | k | v]), conv_w [C, Kc], conv_cache [P, C, Kc - 1] the
    layer's conv state cache, moved on in place. Needs Hk = Hv (each program owns its head's
    channels: with shared q / k heads one program would overwrite a conv state another still
    reads). Returns (output, conv cache, state cache)."""
    rows, c = x.shape
    slots_n, hv, dk, dv = state.shape
    hk = (c - hv * dv) // (2 * dk)
    if hk != hv or 2 * hk * dk + hv * dv != c or conv_w.shape[0] != c \
            or conv_cache.shape != (slots_n, c, conv_w.shape[1] - 1):
        raise ValueError(f"decode_conv_layer_in_place: x {x.shape}, conv_w {conv_w.shape}, conv "
                         f"cache {conv_cache.shape} do not fit the state cache {state.shape} "
                         f"with as many key heads as value heads")
    _check_layer("decode_conv_layer_in_place", rows, hv, dv, a, b, z, state)
    kernel = functools.partial(_layer_kernel, rep=1, hk=hk, eps=float(eps),
                               scale=float(dk ** -0.5 if scale is None else scale),
                               qk_eps=float(qk_eps), conv=True)
    args = [*_row_flags(slots, keep, has, slots_n), x, conv_w, a, b, a_log, dt_bias, z, norm,
            conv_cache, state]
    return _layer_call(args, 2, z.dtype, (rows, hv), kernel, num_warps, interpret,
                       "gdn_decode_conv_layer_in_place")


def decode_in_place(q, k, v, g, beta, state, slots, keep, has, *, scale=None,
                    block_v: int | None = None, num_warps: int = 4, interpret: bool = False,
                    rows=None):
    """One gated delta step for each row, reading and writing the state cache in place.

    Args:
      q, k: [N, Hk, Dk] (normalized, the model's dtype); v: [N, Hv, Dv]; g, beta: [N, Hv] (the
        log decay and the write strength); state: [P, Hv, Dk, Dv] float32, the cache (donated:
        the result is written into it); slots: [N] int32 each row's state slot; keep, has: [N]
        bool (keep False: start from zeros; has False: no token, the state stays).
      scale: of q (None: Dk ** -0.5); block_v: value columns per program (divides Dv; None:
        min(32, Dv)); num_warps: per program.
      rows: None, or [N] int32: row n's inputs are row rows[n] of q, k, v, g, beta ([T, ...],
        a step's rows: read by the kernel, no gather before it); a row with has and keep False
        then leaves its state unread and unwritten (the same cache).
    Returns:
      out [N, Hv, Dv] float32 (zeros where has is False), the updated cache [P, Hv, Dk, Dv].
    """
    n_in, hk, dk = k.shape
    slots_n, hv, dk_s, dv = state.shape
    if q.shape != k.shape or v.shape[:2] != (n_in, hv) or dk_s != dk or hv % hk:
        raise ValueError(f"decode_in_place: q {q.shape}, k {k.shape}, v {v.shape} do not fit the "
                         f"state cache {state.shape}")
    n = n_in if rows is None else rows.shape[0]
    if state.dtype != _F32:
        raise ValueError(f"decode_in_place: the state cache must be float32, got {state.dtype}")
    block_v = min(32, dv) if block_v is None else block_v
    if dv % block_v:
        raise ValueError(f"decode_in_place: block_v {block_v} does not divide Dv {dv}")
    scale = dk ** -0.5 if scale is None else scale
    flags = [jnp.asarray(x).astype(jnp.int32) for x in (keep, has)]
    slots = jnp.clip(jnp.asarray(slots, jnp.int32), 0, slots_n - 1)  # never write outside
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    indexed = [] if rows is None else [jnp.clip(jnp.asarray(rows, jnp.int32), 0, n_in - 1)]
    args = [slots, *flags, *indexed, q, k, v, g, beta, state]
    kernel = functools.partial(_kernel, rep=hv // hk, scale=float(scale), block_v=block_v,
                               indexed=bool(indexed))
    out = jax.ShapeDtypeStruct((n, hv, dv), _F32)
    return pl.pallas_call(
        kernel, grid=(n, hv, dv // block_v),
        in_specs=[whole(x) for x in args],
        out_specs=[whole(out), whole(state)],
        out_shape=[out, jax.ShapeDtypeStruct(state.shape, _F32)],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_decode_in_place",
    )(*args)
