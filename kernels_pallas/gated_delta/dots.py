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
