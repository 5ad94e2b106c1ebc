"""Initial states of a packed gated delta stream, read where they live (no table built).

A ragged step's sequences start from rows of a state table: the flow from each sequence's state
in the layer's cache, a span step's local pieces from zero or a long span's entry B, its
transitions from I or the entry's A (minipic_jax/models/qwen3_5_joint.py). Built as one array,
that table was a gather, a concatenation and (for the scan's "vk" layout) a transposed copy of
S + 2 + 2 Mc states per GDN layer: 34 MiB a layer at rag's 16 seats, ~0.7 ms of a 14 ms warm span
step on an H200 (benchmarks/RESULTS.md). `StateRows` names each row instead: row i is
`sources[kind[i]][index[i]]` (a source with a layer: `[index[i], layer]`), zeros (kind ZERO)
or the identity (kind EYE, Dk = Dv). The scan kernel loads its sequence's row tile by tile
(`load_tile`, ragged_triton.py); XLA paths gather the rows they need (`take`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ZERO, EYE = -1, -2
# False: the scan kernel gets the table built (gathered, concatenated, transposed) as before
# session 27, for A/B timing (benchmarks/span_step_work.py's forms); read when a step is traced
STATES_IN_PLACE = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateRows:
    sources: tuple  # arrays [P, Hv, Dk, Dv], or [P, Lg, Hv, Dk, Dv] where layers[i] is an int
    kind: jax.Array  # [N] int32: the source of each row, ZERO or EYE
    index: jax.Array  # [N] int32: its row in that source (ignored for ZERO / EYE)
    layers: tuple = dataclasses.field(default=(), metadata=dict(static=True))  # per source
    # the prefill writes sequence i's final state to sources[0][index[i]] in place (zeros for
    # a ZERO row without tokens, the row kept for others without) and returns sources[0] as
    # the finals: no [S] finals and no scatter after the kernel (`from_cache`)
    write_final: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # with write_final: None (row i is sequence i's and its final goes to index[i]), or
    # [n_seq] int32, the sources[0] row each sequence's final goes to (-1: none; a sequence
    # without tokens named here ends in zeros, so name only those starting from zeros): a table
    # whose rows are not one per sequence (a span step's joint stream, minipic_jax/models/
    # qwen3_5_joint.py), sources after the first read only
    final_rows: jax.Array | None = None
    # with final_rows: None, or (first chunk, count) [n_seq] int32 each: where count >= 0 the
    # sequence's final is instead the state from zero after packed chunks first .. + count (a
    # carried span piece's, minipic_jax/models/qwen3_5_joint.py), computed by the sequence's own
    # program (a program writes only the row it read)
    final_from: tuple | None = None

    def __post_init__(self):
        if len(self.layers) not in (0, len(self.sources)):
            raise ValueError(f"StateRows: {len(self.layers)} layers for "
                             f"{len(self.sources)} sources")
        if self.write_final and (self.layer_of(0) is not None or (
                self.final_rows is None and len(self.sources) != 1)):
            raise ValueError("StateRows: write_final needs its first source without a layer (a "
                             "state cache), and one source unless final_rows names each "
                             f"sequence's row; got {len(self.sources)} sources, layers "
                             f"{self.layers}")

    @property
    def shape(self) -> tuple:
        return tuple(self.kind.shape) + tuple(self.sources[0].shape[-3:])

    def layer_of(self, i: int):
        return self.layers[i] if self.layers else None

    def take(self, rows) -> jax.Array:
        """The states of table rows `rows` [K] as float32 [K, Hv, Dk, Dv] (XLA: one gather per
        source, selected by kind)."""
        kind, index = self.kind[rows], self.index[rows]
        out = jnp.zeros(tuple(kind.shape) + self.shape[1:], jnp.float32)
        for i, src in enumerate(self.sources):
            at = jnp.clip(index, 0, src.shape[0] - 1)
            got = src[at] if self.layer_of(i) is None else src[at, self.layer_of(i)]
            out = jnp.where((kind == i)[:, None, None, None], got.astype(jnp.float32), out)
        dk, dv = self.shape[-2:]
        eye = jnp.eye(dk, dv, dtype=jnp.float32)
        return jnp.where((kind == EYE)[:, None, None, None], eye, out)

    def materialize(self) -> jax.Array:
        """The whole table [N, Hv, Dk, Dv] float32 (the XLA scan's and the serial kernel's)."""
        return self.take(jnp.arange(self.kind.shape[0], dtype=jnp.int32))


def from_cache(cache, slots, keep, write_final: bool = False) -> StateRows:
    """A step's flow states: sequence i from cache slot slots[i], zeros where keep[i] is False;
    with write_final its final state goes back to slot slots[i] (StateRows.write_final)."""
    slots = jnp.asarray(slots, jnp.int32)
    return StateRows((cache,), jnp.where(keep, 0, ZERO).astype(jnp.int32), slots,
                     write_final=write_final)


def written_finals(state0, final_rows) -> jax.Array:
    """What a write_final prefill returns where its kernel does not write in place (the XLA
    scan): the source with each row's final state [N, ...] (`final_rows`, already the row's
    own state or zeros where the sequence had no tokens) stored at its index (or at
    state0.final_rows, -1 dropped)."""
    src = state0.sources[0]
    at = state0.index
    if state0.final_rows is not None:
        at = jnp.where(state0.final_rows >= 0, state0.final_rows, src.shape[0])
    return src.at[at].set(final_rows.astype(src.dtype), mode="drop")


def rows_of(state0, rows) -> jax.Array:
    """state0[rows] float32 for an array or a StateRows."""
    if isinstance(state0, StateRows):
        return state0.take(jnp.asarray(rows, jnp.int32))
    return state0[rows].astype(jnp.float32)


def as_array(state0) -> jax.Array:
    """state0 as one float32 array (a StateRows materialized)."""
    return state0.materialize() if isinstance(state0, StateRows) else state0


def load_tile(row, kind_ref, index_ref, src_refs, *, j, block_v: int, transpose: bool):
    """Inside the scan kernel: value block j of table row `row` (a traced int) as a float32
    [Dk, block_v] tile ([block_v, Dk] with `transpose`). kind_ref / index_ref: the StateRows'
    [N] kind and index; src_refs: its sources' blocks, each [P, Dk, block_v] (the program's
    head and value block)."""
    kind, index = kind_ref[row], index_ref[row]
    tile = None
    for i, ref in enumerate(src_refs):
        got = ref[jnp.clip(index, 0, ref.shape[0] - 1)].astype(jnp.float32)
        tile = jnp.where(kind == i, got, 0.0 if tile is None else tile)
    tile = jnp.where(kind == EYE, eye_tile(tile.shape, j=j, block_v=block_v), tile)
    return tile.T if transpose else tile


def eye_tile(shape, *, j, block_v: int):
    """Inside a kernel: value block j of the identity, a float32 [Dk, block_v] tile (`shape`)."""
    r = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    c = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + j * block_v
    return jnp.where(r == c, 1.0, 0.0)


def source_spec(src, layer, dk: int, block_v: int):
    """Inside a scan kernel's pallas_call (grid (Hv, Dv / BV, ...)): a StateRows source's block
    for program (head h, value block j), every row's [Dk, BV] tile ([P, Lg, Hv, Dk, Dv]
    sources: of `layer`)."""
    if layer is None:
        return pl.BlockSpec((src.shape[0], None, dk, block_v), lambda h, j, *_: (0, h, 0, j))
    return pl.BlockSpec((src.shape[0], None, None, dk, block_v),
                        lambda h, j, *_: (0, layer, h, 0, j))
