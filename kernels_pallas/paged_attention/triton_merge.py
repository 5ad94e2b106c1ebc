"""The ragged kernel's split-K partials merged (Pallas, Triton lowering; triton_ragged.py).

Each of a tile's `splits` programs stored its normalized partial output rows [n_out, D] (float32)
and their log-sum-exps [n_out]; a program whose share of the key steps was empty stored only
lse = -inf and left its output rows unwritten. The merge weighs each split's rows by
exp(lse - max lse): an XLA elementwise pass reads every split's rows, written or not (at a
128-token step over a 25,600-key table, 32 splits of 1 MB a layer when the context is short and
one split did all the work). Here one program per ROWS output rows loads a split's rows only
where its weight is non-zero (a masked load moves no bytes for masked rows), so the merge reads
what the splits wrote. Rows of tokens past cu_q_lens[-1] are not stored: with `out` aliased they
keep its contents, as the unsplit kernel leaves them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.paged_attention.triton_common import NEG_INF

ROWS = 16  # output rows per program: [ROWS, D] float32 accumulators


def _merge_kernel(cu_ref, lse_ref, part_ref, *rest, splits, stride, rows_out, heads, head_dim):
    o_ref = rest[-1]
    r = pl.program_id(0) * ROWS + lax.broadcasted_iota(jnp.int32, (ROWS,), 0)
    ok = r < rows_out
    written = ok & (r // heads < cu_ref[cu_ref.shape[0] - 1])
    col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

    def lse_of(s):
        return pltriton.load(lse_ref.at[s * stride + r], mask=written, other=NEG_INF)

    m = lax.fori_loop(0, splits, lambda s, m: jnp.maximum(m, lse_of(s)),
                      jnp.full((ROWS,), NEG_INF, jnp.float32))
    m = jnp.where(m == NEG_INF, 0.0, m)

    def add(s, carry):
        acc, den = carry
        w = jnp.exp(lse_of(s) - m)  # 0 where the split saw no key
        take = (w > 0.0)[:, None] & (col < head_dim)
        o = pltriton.load(part_ref.at[(s * stride + r)[:, None], col], mask=take, other=0.0)
        return acc + w[:, None] * o, den + w

    acc, den = lax.fori_loop(0, splits, add, (jnp.zeros((ROWS, head_dim), jnp.float32),
                                              jnp.zeros((ROWS,), jnp.float32)))
    out = acc / jnp.where(den == 0.0, 1.0, den)[:, None]
    pltriton.store(o_ref.at[r[:, None], col], out.astype(o_ref.dtype),
                   mask=jnp.broadcast_to(written[:, None], out.shape))


def merge_split_rows(part, lse, cu_q_lens, *, splits: int, tokens: int, heads: int, dtype,
                     out=None, interpret: bool = False):
    """part [splits * n_out, D] float32, lse [splits * n_out] (rows r < tokens * heads of each
    split are output rows, token r // heads) -> [n_out, D] of `dtype`: the merged rows of tokens
    below cu_q_lens[-1]; other rows are `out`'s (aliased) or unwritten."""
    n_out, head_dim = part.shape[0] // splits, part.shape[1]
    rows_out = tokens * heads
    args = [cu_q_lens, lse, part]
    aliases = {}
    if out is not None:
        aliases = {len(args): 0}
        args.append(out)
    kernel = functools.partial(_merge_kernel, splits=splits, stride=n_out, rows_out=rows_out,
                               heads=heads, head_dim=head_dim)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_out, head_dim), dtype),
        grid=(-(-rows_out // ROWS),),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_split_merge",
    )(*args)
