"""Helpers of the Triton-lowered Pallas kernels (triton_ragged.py, triton_decode.py): tile
sizes, dots in float32, one online-softmax step, fast cos/sin of float32 angles."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.problem import is_pow2

NEG_INF = float("-inf")


def tile_rows(block_q: int, group: int) -> int:
    """Query rows of a tile: block_q * G rounded up to a power of 2 >= 16 (Triton dot limits)."""
    rows = 16
    while rows < block_q * group:
        rows *= 2
    return rows


def dot(a, b, contract_b, precise):
    """a [M, C] . b (contracting b's dim contract_b) -> [M, N] float32."""
    precision = lax.Precision.HIGHEST if precise else None
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_nt(a, b, precise):
    """a [M, C] . b [N, C]^T in float32; tiny C (< 16) falls back to broadcast-sum."""
    if a.shape[1] >= 16:
        return dot(a, b, 1, precise)
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=2)


def online_softmax(s, mask, m_i, l_i):
    """One flash-attention step over a score tile s [M, N] (masked to -inf where ~mask):
    returns (p [M, N], alpha [M] to rescale the accumulator by, new row max, new row sum).
    Fully masked rows keep max -inf and take exp(.. - 0) = 0 (no NaN)."""
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + jnp.sum(p, axis=1)


TWO_PI_HI = 6.28125  # 2*pi split so that n * TWO_PI_HI is exact for |n| < 2**15
TWO_PI_LO = 0.0019353071795864769


def cos_sin(angle, fast):
    """cos/sin of float32 angles. fast (GPU): Cody-Waite reduction to [-pi, pi], then the SFU's
    cos.approx/sin.approx (abs error ~1e-6); libdevice's precise cosf/sinf cost ~25 instructions
    each and made RoPE-at-read 5x slower than the rotated kernel. Interpret mode: jnp on the
    reduced angle (exercises the reduction on CPU)."""
    n = jnp.floor(angle * (1.0 / (2.0 * math.pi)) + 0.5)
    r = (angle - n * TWO_PI_HI) - n * TWO_PI_LO
    if not fast:
        return jnp.cos(r), jnp.sin(r)
    shape = [jax.ShapeDtypeStruct(r.shape, jnp.float32)]
    [cos] = pltriton.elementwise_inline_asm("cos.approx.ftz.f32 $0, $1;", args=[r],
                                            constraints="=r,r", pack=1, result_shape_dtypes=shape)
    [sin] = pltriton.elementwise_inline_asm("sin.approx.ftz.f32 $0, $1;", args=[r],
                                            constraints="=r,r", pack=1, result_shape_dtypes=shape)
    return cos, sin


def triton_limits(problem, block_k: int) -> str:
    """Why the Triton kernels cannot take these shapes ('' when they can): Triton tiles are
    powers of 2."""
    p = problem
    if not is_pow2(p.head_dim) or p.head_dim < 16:
        return f"needs a power-of-2 head_dim >= 16, got {p.head_dim}"
    if p.rotary_half and not is_pow2(p.rotary_half):
        return f"needs a power-of-2 rotary half-dim, got {p.rotary_half}"
    if not is_pow2(block_k) or block_k % p.block_size or block_k < 16:
        return f"needs block_k (power of 2, >= 16) to be a multiple of page size {p.block_size}"
    return ""
