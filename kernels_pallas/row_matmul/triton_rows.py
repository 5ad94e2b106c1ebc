"""A decode step's few rows times a layer's weights, with the RMSNorm before or the residual add
after in the same kernel, Pallas (Triton lowering).

At decode a block's MLP is a pass over its weights for a handful of rows, and XLA runs it as
several kernels (the norm, the gate/up product, silu(gate) * up, the down product, the residual
add): each a launch of a few microseconds around ~5 us of weight reads. Here two kernels do it:

  norm_matmul     out = h W,  h = RMSNorm(x) (the block's norm, cast to the model dtype as the
                  XLA form casts it); with `swiglu` silu(h W_gate) * (h W_up), W = [W_gate | W_up]
  matmul_residual out = residual + y W (with `split_k`: float32 partials of K / S rows each, the
                  sum and the residual add an XLA fusion)

One program per BN output columns reads its [E, BN] weight columns once in BK-row blocks
(the rows' x / y blocks from L2), float32 accumulation, the products and epilogue rounded to the
model dtype where the XLA form rounds. Triton rather than Mosaic GPU: the rows are 8-64 (a
decode bucket), below a warpgroup's 64-row wgmma tile, and the cost is the weight stream, not the
tensor cores; Triton takes an M = 8 dot and reduces a row across a tile's columns directly (the
norm), as decode_triton.py's kernels do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.gated_delta.decode_triton import sigmoid_in

_F32 = jnp.float32


def _inv_rms(x_ref, eps, block_k):
    """[M, 1] float32: 1 / sqrt(mean(x^2) + eps) of each row of x [M, E] (layers.rms_norm),
    the squares summed over BK-column blocks (a row of Llama-8B's 4,096 at 64 rows would not
    fit a program's registers whole)."""
    m, e = x_ref.shape

    def body(i, acc):
        x = x_ref[:, pl.ds(pl.multiple_of(i * block_k, block_k), block_k)].astype(_F32)
        return acc + jnp.sum(x * x, axis=1, keepdims=True)

    sq = jax.lax.fori_loop(0, e // block_k, body, jnp.zeros((m, 1), _F32))
    return jax.lax.rsqrt(sq / e + eps)


def _dot(a, b):
    """a @ b, float32 accumulation; float32 operands in IEEE float32 (Triton's default for them
    is TF32, as XLA's on a GPU: the model traces float32 steps at HIGHEST precision)."""
    exact = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, preferred_element_type=_F32, precision=exact)


def _normed(x_ref, w_ref, inv, ks, unit_offset, dtype):
    """Columns `ks` of RMSNorm(x) in the model dtype, as layers.rms_norm rounds them."""
    x = x_ref[:, ks].astype(_F32) * inv  # [M, BK]
    w = w_ref[ks]
    if unit_offset:  # Qwen3.5: (1 + w) in float32, then cast
        return (x * (1.0 + w.astype(_F32))[None, :]).astype(dtype)
    return w[None, :] * x.astype(dtype)  # Llama: cast, then times w


def _norm_kernel(x_ref, nw_ref, *refs, eps, unit_offset, block_k):
    # x [M, E]; nw [E]; then one weight block [E, BN] (norm_matmul: o = h W) or two (norm_swiglu:
    # this program's gate and up columns, o = silu(h W_gate) * (h W_up)); o [M, BN]
    *w_refs, o_ref = refs
    dtype = o_ref.dtype
    inv = _inv_rms(x_ref, eps, block_k)
    e, bn = w_refs[0].shape

    def body(i, accs):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        h = _normed(x_ref, nw_ref, inv, ks, unit_offset, dtype)
        return tuple(acc + _dot(h, w_ref[ks, :]) for acc, w_ref in zip(accs, w_refs))

    zero = jnp.zeros((x_ref.shape[0], bn), _F32)
    accs = jax.lax.fori_loop(0, e // block_k, body, (zero,) * len(w_refs))
    o_ref[...] = accs[0].astype(dtype) if len(accs) == 1 else _swiglu(*accs, dtype)


def _swiglu(g, u, dtype):
    """silu(g) * u of float32 products g, u [M, BN] as the model computes it in `dtype`: the
    products rounded, then op by op (jax.nn.silu: the logistic as JAX expands it, `sigmoid_in`,
    times g, rounded), then times u, rounded."""
    def r(v):
        return v.astype(dtype).astype(_F32)
    g, u = r(g), r(u)
    return (r(g * sigmoid_in(g, dtype)) * u).astype(dtype)


def _matmul_residual_kernel(y_ref, w_ref, r_ref, o_ref, *, block_k):
    # y [M, K]; w [K, BN]; residual, o [M, BN]
    acc = _row_products(y_ref, w_ref, block_k)
    dtype = o_ref.dtype
    o_ref[...] = _add_rounded(r_ref[...], acc, dtype)


def _partial_kernel(y_ref, w_ref, o_ref, *, block_k):
    # split-K: y [M, K / S]; w [K / S, BN]; o [1, M, BN] float32, this K slice's products
    o_ref[0] = _row_products(y_ref, w_ref, block_k)


def _row_products(y_ref, w_ref, block_k):
    """[M, BN] float32: y W over the block's K rows in BK-row steps."""
    k, bn = w_ref.shape

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + _dot(y_ref[:, ks], w_ref[ks, :])

    return jax.lax.fori_loop(0, k // block_k, body, jnp.zeros((y_ref.shape[0], bn), _F32))


def _add_rounded(residual, acc, dtype):
    """residual + acc as the XLA form rounds it: the product to the model dtype, then the add."""
    return (residual.astype(_F32) + acc.astype(dtype).astype(_F32)).astype(dtype)


def _whole(x):
    return pl.BlockSpec(x.shape, lambda j: (0,) * x.ndim)


@functools.partial(jax.jit, static_argnames=("eps", "unit_offset", "swiglu", "block_n",
                                             "block_k", "num_warps", "num_stages",
                                             "interpret"))
def norm_matmul(x, norm_w, w, *, eps: float, unit_offset: bool, swiglu: bool = False,
                block_n: int = 32, block_k: int = 128, num_warps: int = 4, num_stages: int = 2,
                interpret: bool = False):
    """h W for h = RMSNorm(x): x [M, E], norm_w [E], w [E, N] -> [M, N] in x's dtype; with
    `swiglu` (w = [W_gate | W_up], N = 2F) silu(h W_gate) * (h W_up) [M, F]. Shapes checked by
    api.norm_matmul / api.norm_swiglu."""
    m, e = x.shape
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    cols = lambda off: pl.BlockSpec((e, block_n), lambda j: (0, j + off))  # noqa: E731
    w_specs = [cols(0), cols(n // block_n)] if swiglu else [cols(0)]
    kernel = functools.partial(_norm_kernel, eps=eps, unit_offset=unit_offset, block_k=block_k)
    return pl.pallas_call(
        kernel, grid=(n // block_n,), in_specs=[_whole(x), _whole(norm_w)] + w_specs,
        out_specs=pl.BlockSpec((m, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="rows_norm_swiglu" if swiglu else "rows_norm_matmul",
    )(x, norm_w, *([w] * len(w_specs)))


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages",
                                             "split_k", "interpret"))
def matmul_residual(y, w, residual, *, block_n: int = 32, block_k: int = 128,
                    num_warps: int = 4, num_stages: int = 2, split_k: int = 1,
                    interpret: bool = False):
    """residual + y W: y [M, K], w [K, N], residual [M, N] -> [M, N] in residual's dtype.
    `split_k` > 1: S programs a column block, each over K / S rows, writing float32 partial
    products that an XLA fusion sums and adds to the residual (more programs for a narrow
    output: the down product's E columns). Shapes checked by api.matmul_residual."""
    m, k = y.shape
    n = w.shape[1]
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if split_k == 1:
        return pl.pallas_call(
            functools.partial(_matmul_residual_kernel, block_k=block_k), grid=(n // block_n,),
            in_specs=[_whole(y), pl.BlockSpec((k, block_n), lambda j: (0, j)),
                      pl.BlockSpec((m, block_n), lambda j: (0, j))],
            out_specs=pl.BlockSpec((m, block_n), lambda j: (0, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), residual.dtype),
            compiler_params=params, interpret=interpret, name="rows_matmul_residual",
        )(y, w, residual)
    ks = k // split_k  # (block_k divides it: api.matmul_residual picks it so)
    partials = pl.pallas_call(
        functools.partial(_partial_kernel, block_k=block_k), grid=(n // block_n, split_k),
        in_specs=[pl.BlockSpec((m, ks), lambda j, s: (0, s)),
                  pl.BlockSpec((ks, block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((1, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, m, n), _F32),
        compiler_params=params, interpret=interpret, name="rows_matmul_partial",
    )(y, w)
    return _add_partials(residual, partials)


def _add_partials(residual, partials):
    """residual + the summed partials, the product rounded to the model dtype first as the XLA
    form rounds it: by reduce_precision, since XLA (excess precision allowed, its default) drops
    a float32 -> bf16 -> float32 round trip inside a fusion."""
    acc = partials.sum(axis=0)
    dtype = jnp.dtype(residual.dtype)
    if dtype != _F32:
        info = jnp.finfo(dtype)
        acc = jax.lax.reduce_precision(acc, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return (residual.astype(_F32) + acc).astype(dtype)
