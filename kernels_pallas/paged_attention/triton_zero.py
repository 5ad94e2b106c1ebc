"""Fresh KV pages zeroed in Pallas (Triton lowering): one kernel for every page leaf.

A step zeroes the pages its block manager handed out (serving/cache/page_zeroing.py) in each
page leaf, K and V of every attention layer. As XLA scatters that is one kernel a leaf, 12 in
every Qwen3.5-0.8B step and 64 in a Llama-3-8B one, nearly all of them dropping padding ids (a
decode step has a fresh page only where a sequence crosses a block boundary): small kernels
that a step of ~400 pays for in launches (benchmarks/history/gated_delta.md, session 30). Here
one program per page id stores a zero page into every leaf, the leaves aliased in and out;
an id outside [0, P) writes nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def takes(leaves, block_size: int) -> str:
    """Why the kernel cannot zero these page leaves ([P, B, ...] each), or "" when it can: one
    shape and dtype for all, B and the row width B's rows hold powers of 2, int32 offsets."""
    if not leaves:
        return "no page leaves"
    shape, dtype = leaves[0].shape, leaves[0].dtype
    if any(x.shape != shape or x.dtype != dtype for x in leaves):
        return "page leaves of several shapes or dtypes"
    width = 1
    for d in shape[2:]:
        width *= d
    if block_size & (block_size - 1) or width & (width - 1):
        return f"block size {block_size} or page row width {width} not a power of 2"
    if shape[0] * block_size * width >= 2 ** 31:
        return "more than 2**31 elements a leaf (int32 offsets)"
    return ""


def _kernel(ids_ref, *refs, leaves, num_pages, rows, width):
    outs = refs[leaves:]  # the inputs are aliased to them
    page = ids_ref[pl.program_id(0)]

    @pl.when((page >= 0) & (page < num_pages))
    def _():
        r = page * rows + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        c = lax.broadcasted_iota(jnp.int32, (1, width), 1)
        for out in outs:
            pltriton.store(out.at[r, c], jnp.zeros((rows, width), out.dtype))


def zero_pages_triton(leaves, ids, *, num_warps: int = 4, interpret: bool = False):
    """`leaves` ([P, B, ...] page arrays, `takes` says which) with pages `ids` [Z] set to zero,
    in place (ids outside [0, P): none)."""
    why = takes(leaves, leaves[0].shape[1] if leaves else 0)
    if why:
        raise ValueError(f"zero_pages_triton: {why}")
    num_pages, rows = leaves[0].shape[:2]
    width = leaves[0].size // (num_pages * rows)
    flat = [x.reshape(num_pages * rows, width) for x in leaves]
    out = pl.pallas_call(
        functools.partial(_kernel, leaves=len(flat), num_pages=num_pages, rows=rows,
                          width=width),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        input_output_aliases={1 + i: i for i in range(len(flat))},
        grid=(ids.shape[0],),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="zero_pages",
    )(ids.astype(jnp.int32), *flat)
    return [y.reshape(x.shape) for x, y in zip(leaves, out)]
