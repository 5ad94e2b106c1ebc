"""Matmul helpers shared by the Pallas (Triton) gated delta kernels: operands cast to a dot dtype,
float32 accumulation. float32 operands get IEEE float32 math (Triton's default would be TF32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _prec(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot(a, b, dtype):  # a @ b
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32,
                   precision=_prec(dtype))


def dot_t(a, b, dtype):  # a @ b.T
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=_prec(dtype))


def dot_tn(a, b, dtype):  # a.T @ b
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32, precision=_prec(dtype))
