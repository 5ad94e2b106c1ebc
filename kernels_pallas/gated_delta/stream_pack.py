"""A ragged step's packed stream gathered by a kernel that writes only the chunks the step uses.

ragged.py packs a step's rows into chunk-aligned slots (`src`: each slot's source row, >= T for a
slot no row fills) of a stream sized for the worst case: at rag's 1,024 tokens x 16 seats a span
step's joint stream has 122 chunks (7,808 slots) of which ~40 hold rows. XLA's gather
(`ragged.take_rows`) writes every slot: q, k and v 28 MB each a GDN layer, the step's two
largest select fusions (~0.97 ms of a warm span step on an H100, session 33's profile). The
kernels that read the stream already skip chunks >= n_used (dots.chunks_below), so here one
kernel gathers q, k, v, g and beta for chunks < n_used only (zeros in the slots no row fills,
as take_rows) and leaves the rest unwritten. `STREAM_IN_KERNEL` (stream_rows.py) read the source
rows inside the intra and output kernels instead and was slower (s28); this keeps their blocked
loads and moves only the gather.

Grid (NC, tiles): program (c, j) copies columns [j BF, (j + 1) BF) of chunk c's rows of every
operand with more than j tiles; an operand [T, ...] is read as [T * tiles, BF] rows (tiles
innermost) through stream_rows.RowsRef, the gather the in-kernel stream reads use.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import stream_rows

# True: ragged.run_stream's kernel paths gather their packed stream with `pack` (the chunks a
# step uses only); False: XLA's take_rows (every slot). On since session 34 (H100: the gathers'
# 0.84 ms of a warm span step -> 0.23, its busy -0.45 ms; a plain step's -0.27 ms); read when a
# step is traced.
PACK_KERNEL = True
BLOCK_F = 256  # columns a program copies per operand (a power of two)
NAME = "stream_pack"  # the pallas_call's name (tests that count the GDN kernels skip it)


def _pack_kernel(*refs, n_ops: int, tiles: tuple, chunk: int):
    ins, (src_ref, used_ref, live_ref) = refs[:n_ops], refs[n_ops:n_ops + 3]
    outs = refs[n_ops + 3:]
    c, j = pl.program_id(0), pl.program_id(1)  # read here: none under a pl.when (interpreter)

    @pl.when((c < used_ref[0]) & (live_ref[jnp.minimum(c, live_ref.shape[0] - 1)] != 0))
    def _():
        for x_ref, out_ref, n_tiles in zip(ins, outs, tiles):
            def copy(x_ref=x_ref, out_ref=out_ref, n_tiles=n_tiles):  # tile j: a "head" of x
                rows = stream_rows.RowsRef(x_ref, src_ref, c * chunk, jnp.minimum(j, n_tiles - 1),
                                           n_tiles, x_ref.shape[0] // n_tiles, chunk)
                out_ref[...] = rows[...].astype(out_ref.dtype)
            if n_tiles == max(tiles):
                copy()
            else:
                pl.when(j < n_tiles)(copy)


def _tiling(x, block_f: int):
    """(x as [T * tiles, BF] rows, tiles, BF) of an operand [T, ...]."""
    t, f = x.shape[0], math.prod(x.shape[1:])
    bf = min(block_f, f)
    if f % bf or bf & (bf - 1):
        raise ValueError(f"stream_pack: an operand's row of {f} values does not split into "
                         f"blocks of a power of two <= {block_f} (shape {x.shape})")
    return x.reshape(t * (f // bf), bf), f // bf, bf


def pack(xs, src, n_used, *, chunk: int, block_f: int = BLOCK_F, num_warps: int = 4,
         interpret: bool = False, live=None):
    """Each of xs ([T, ...], the same T) gathered into the packed slots src [NC * C] int32:
    take_rows(x, src) in chunks [0, n_used) (an int32 scalar) that live ([NC] int32, None:
    all) marks nonzero, undefined in the others (the stream's kernels never read them: chunks
    past n_used and borrowed ones, ragged_triton.own_chunks). Returns a list of [NC * C, ...]
    arrays in xs' dtypes."""
    slots = src.shape[0]
    if slots % chunk:
        raise ValueError(f"stream_pack: {slots} slots are not whole chunks of {chunk}")
    n_chunks = slots // chunk
    flat, tiles, blocks = zip(*(_tiling(x, block_f) for x in xs))
    used = jnp.reshape(jnp.minimum(n_used, n_chunks), (1,)).astype(jnp.int32)
    live = jnp.ones(n_chunks, jnp.int32) if live is None else jnp.asarray(live, jnp.int32)
    out_specs = [pl.BlockSpec((chunk, bf), lambda c, j, n=n: (c, jnp.minimum(j, n - 1)))
                 for bf, n in zip(blocks, tiles)]
    out = pl.pallas_call(
        functools.partial(_pack_kernel, n_ops=len(xs), tiles=tiles, chunk=chunk),
        grid=(n_chunks, max(tiles)),
        in_specs=[stream_rows.whole(a) for a in flat]
        + [stream_rows.whole(src), pl.BlockSpec((1,), lambda *_: (0,)), stream_rows.whole(live)],
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((slots, n * bf), x.dtype)
                   for x, n, bf in zip(xs, tiles, blocks)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=NAME,
    )(*flat, src.astype(jnp.int32), used, live)
    return [o.reshape((slots,) + x.shape[1:]) for o, x in zip(out, xs)]
