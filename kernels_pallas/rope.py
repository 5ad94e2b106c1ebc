"""Rotate-half RoPE, HF transformers' convention, shared by the kernels and the models.

cos/sin are computed in float32 from `positions * inv_freq` (the same product HF forms), scaled by
`attention_scaling`, cast to the input dtype, and applied to the first R = 2 * len(inv_freq) dims
of each head; the remaining D - R dims pass through (partial rotary).
"""

import jax.numpy as jnp


def rope_cos_sin(positions, inv_freq, attention_scaling: float = 1.0):
    """positions [T] int -> cos, sin [T, R] float32 (R = 2 * len(inv_freq))."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, R]
    return jnp.cos(emb) * attention_scaling, jnp.sin(emb) * attention_scaling


def apply_rope(x, positions, inv_freq, attention_scaling: float = 1.0):
    """x [T, N, D], positions [T] -> x rotated by each token's position, same dtype as x."""
    rot = 2 * inv_freq.shape[-1]
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling)
    cos = cos.astype(x.dtype)[:, None, :]  # [T, 1, R]
    sin = sin.astype(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated_half = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated_half * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def rope_f32(x, positions, inv_freq, attention_scaling: float = 1.0, out_dtype=jnp.float32):
    """x [..., N, D], positions [...] (x's leading axes) -> x rotated by its positions in float32
    math, returned in out_dtype (float32 by default): for keys gathered from the pages and
    rotated once before a kernel reads them many times (the float32 products keep the rotation
    exact to the input's dtype)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)  # [..., R/2]
    return rotate_f32(x, jnp.cos(ang) * attention_scaling, jnp.sin(ang) * attention_scaling,
                      out_dtype)


def rotate_f32(x, cos, sin, out_dtype=jnp.float32):
    """x [..., N, D] rotated by cos, sin [..., R/2] (x's leading axes, attention_scaling already
    applied; e.g. rows of decode_common.rope_table) in float32 math; returns out_dtype. Each
    half is cast before the halves are joined: the same values as casting the joined float32
    array, but XLA then never holds the float32 halves (at the tulu3 shape, max_model_len 33,792,
    the overflow step's 64 gathered tables: 10 GiB of them per layer; tests/test_rope_memory.py)."""
    half = cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]  # [..., 1, R/2]
    xf = x.astype(jnp.float32)
    lo, hi = xf[..., :half], xf[..., half:2 * half]
    parts = [lo * cos - hi * sin, hi * cos + lo * sin]
    if x.shape[-1] > 2 * half:  # partial rotary: the rest passes through
        parts.append(xf[..., 2 * half:])
    return jnp.concatenate([p.astype(out_dtype) for p in parts], -1)
