"""Matmul precision for the gated delta rule, and helpers shared by its Pallas (Triton) kernels:
operands cast to a dot dtype, float32 accumulation.

One rule everywhere in this folder: float32 inputs get IEEE float32 math (on a GPU, XLA's and
Triton's default for float32 dots would be TF32, about 1e-3 relative); bf16/f16 inputs keep the
default tensor-core math with float32 accumulation."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def _prec(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def is_exact(dot_dtype) -> bool:
    """Float32 dots (None: the float32 default): IEEE math, and the kernels' decay exponents
    summed directly over each segment (bf16 / f16 dots keep differences of cumsums)."""
    return dot_dtype is None or jnp.dtype(dot_dtype) == jnp.float32


def exact_for(dtype):
    """Context for tracing the XLA path: float32 inputs -> every dot at HIGHEST precision (read at
    trace time by `jax.lax.dot_general`), other dtypes -> the default."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def dot(a, b, dtype):  # a @ b
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32,
                   precision=_prec(dtype))


def dot_t(a, b, dtype):  # a @ b.T
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=_prec(dtype))


def dot_tn(a, b, dtype):  # a.T @ b
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=_prec(dtype))


def chunks_below(kernel, n_in: int, used, n_chunks: int):
    """`kernel(*in_refs, *out_refs)` of a grid (N, NT, H), run only for chunks (grid axis 1) below
    `used` (an int32 scalar; None: every chunk, the kernel unchanged), so a packed stream sized
    for the worst case (ragged.py) costs its used chunks only; `used` (count, live [NT] int32)
    also skips the chunks live marks 0 (borrowed ones: ragged_triton.own_chunks). The skipped
    chunks' output blocks are left unwritten; callers never read them. Returns (kernel, extra
    in_specs, extra args): the count travels as one more input, a [1] int32 block after the
    n_in others (then live, whole)."""
    if used is None:
        return kernel, [], []
    from jax.experimental import pallas as pl
    count, live = used if isinstance(used, tuple) else (used, None)
    n_extra = 1 if live is None else 2

    def body(*refs):
        ins, extra, outs = refs[:n_in], refs[n_in:n_in + n_extra], refs[n_in + n_extra:]
        c = pl.program_id(1)
        run = c < extra[0][0]
        if live is not None:
            run = run & (extra[1][jnp.minimum(c, n_chunks - 1)] != 0)

        @pl.when(run)
        def _():
            kernel(*ins, *outs)
    count = jnp.reshape(jnp.minimum(count, n_chunks), (1,)).astype(jnp.int32)
    specs, args = [pl.BlockSpec((1,), lambda *_: (0,))], [count]
    if live is not None:
        specs.append(pl.BlockSpec((n_chunks,), lambda *_: (0,)))
        args.append(jnp.asarray(live, jnp.int32))
    return body, specs, args
