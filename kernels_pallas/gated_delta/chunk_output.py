"""One chunk's output of the chunked gated delta rule, inside a Pallas (Triton backend) kernel:

    O = (scale Q exp(gc)) S + tril(scale Q K^T Gamma) V'

with S the state entering the chunk and V' = U - W S its corrected values. The output kernel
(fused_triton.py) computes it from the per-chunk states the scan wrote; the scan computes it in
place (`scan_fused.state_scan(output=...)`), where S and V' are still in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta.chunked import segment_sums
from kernels_pallas.gated_delta.dots import dot as _dot, dot_t as _dot_t, is_exact


def output_tile(q, k, g, v_new, s, *, scale, dot_dtype, states_t):
    """O [C, BV] float32 of one chunk: q / k [C, Dk], g [C] float32 gates, v_new [C, BV], s the
    state entering the chunk, [Dk, BV] ([BV, Dk] if states_t). Operands meet the MMAs in
    dot_dtype (s and V' as the unfused kernels store them)."""
    chunk = g.shape[0]
    gc = jnp.cumsum(g)
    q = q.astype(jnp.float32) * scale
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    # float32: exponents summed directly (exact to a few ulps of each segment); bf16 / f16 dots
    # keep the difference of cumsums (its ~eps32 * |gc| exponent error is far below their
    # rounding, and the [C, C] segment sums are a measurable share of a long prefill on the H200:
    # benchmarks/RESULTS.md, Gated DeltaNet)
    seg = segment_sums(g) if is_exact(dot_dtype) else gc[:, None] - gc[None, :]
    gamma = jnp.exp(jnp.where(rows >= cols, seg, -jnp.inf))
    attn = _dot_t(q, k, dot_dtype) * gamma  # [C, C]
    qg = q * jnp.exp(gc)[:, None]
    inter = _dot_t(qg, s, dot_dtype) if states_t else _dot(qg, s, dot_dtype)
    return inter + _dot(attn, v_new, dot_dtype)
