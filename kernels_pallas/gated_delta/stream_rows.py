"""A ragged step's packed stream read through its source rows inside the kernels.

ragged.py packs a step's rows into chunk-aligned slots (`src`: the source row of each slot, >= T
for a slot no row fills), and the stream is sized for the worst case: at rag's 1,024 tokens x 16
seats a span step's joint stream has 143 chunks (9,152 slots) for ~2,100 rows used. Gathered by
XLA (`take_rows`) every slot is written, used or not (q, k, v: 37.5 MB each a GDN layer; ~0.9 ms
of a warm span step on an H100, benchmarks/history/gated_delta.md). With `STREAM_IN_KERNEL`, the
intra-chunk and output kernels get the source arrays and `src` instead and load each chunk's rows
through it (`RowsRef`), so only the chunks a step uses are read, and nothing is written first.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

# True: the kernels read the source rows; False: XLA gathers the packed stream first (the form
# the in-kernel reads equal bit for bit, tests/test_stream_rows.py). Off until a device has
# compiled and timed it (benchmarks/history/scripts/s28_device.sh; CPU counts: -0.76 / -2.1 GB of XLA
# bytes a plain / warm span step at rag's shape); read when a step is traced (ragged.run_stream)
STREAM_IN_KERNEL = False


class RowsRef:
    """A kernel's view of packed-stream operand x [slots, (D)] for one (chunk, head) program:
    `ref[...]` / `ref[pl.ds(start, size)]` give the chunk's rows as the BlockSpec'd packed
    block would (zeros where a slot holds no row), loaded from the source ref [T * heads, D] or
    [T * heads] (rows of the source, heads innermost) through src_ref [slots]."""

    def __init__(self, x_ref, src_ref, base, head, heads: int, rows: int, chunk: int):
        self.x_ref, self.src_ref, self.base = x_ref, src_ref, base
        self.head, self.heads, self.rows, self.chunk = head, heads, rows, chunk

    def __getitem__(self, idx):
        start, size = (0, self.chunk) if idx is Ellipsis else (idx.start, idx.size)
        src = self.src_ref[pl.ds(self.base + start, size)]
        ok = src < self.rows
        flat = jnp.minimum(src, self.rows - 1) * self.heads + self.head
        if len(self.x_ref.shape) == 1:
            return jnp.where(ok, self.x_ref[flat], 0)
        return jnp.where(ok[:, None], self.x_ref[flat, :], 0)


def flat_source(x):
    """A source operand as the kernels index it: [T, H, D] -> [T * H, D], [T, H] -> [T * H]."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def whole(x):
    """The BlockSpec of an operand every program reads whole (a source, src)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def through_rows(kernel, views, n_count: int, chunk: int):
    """kernel(*ins, *count, *outs) of a grid (1, NT, Hv) whose ins are packed blocks, as a body
    taking (*ins, *count, *srcs, *outs): views[i] = None keeps input i, or (src index, heads,
    head divisor, source rows) reads it as a RowsRef through srcs[src index] (head h // divisor
    of `heads`). The chunk and head ids are read before the kernel (and before any pl.when it
    holds: the interpreter has no program_id under one)."""
    n_in, n_src = len(views), 1 + max(v[0] for v in views if v is not None)

    def body(*refs):
        c, h = pl.program_id(1), pl.program_id(2)
        ins, rest = refs[:n_in], refs[n_in:]
        count, srcs, outs = rest[:n_count], rest[n_count:n_count + n_src], rest[n_count + n_src:]
        wrapped = [ref if v is None else RowsRef(ref, srcs[v[0]], c * chunk, h // v[2], v[1],
                                                 v[3], chunk)
                   for ref, v in zip(ins, views)]
        kernel(*wrapped, *count, *outs)
    return body
