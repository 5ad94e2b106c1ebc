"""The XLA (plain jnp) forms of row_matmul's kernels: a block's RMSNorm and SwiGLU MLP as the
model computes them (minipic_jax/models/layers.py; tests/test_row_matmul.py checks they agree)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float, unit_offset: bool):
    """HF's RMSNorm: normalise in float32; Qwen3.5 multiplies by (1 + w) in float32 then casts,
    Llama casts then multiplies by w."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def mlp(x, norm_w, w_gate_up, w_down, *, eps: float, unit_offset: bool):
    """x + the SwiGLU MLP of RMSNorm(x): w_gate_up [E, 2F] = [W_gate | W_up], w_down [F, E]."""
    h = rms_norm(x, norm_w, eps, unit_offset)
    f = w_down.shape[0]
    gate_up = jnp.einsum("te,ef->tf", h, w_gate_up)
    return x + jnp.einsum("tf,fe->te", jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:], w_down)
