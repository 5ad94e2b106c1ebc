"""Cached span maps of a hybrid model's recurrent layers, and the entry state they compose to.

A span (SSEP segment) leaves in every Gated DeltaNet layer an affine map of the delta state,
(A_span [Hv, Dk, Dk], B_span [Hv, Dk, Dv]) (kernels_pallas/gated_delta/affine.py), and the last
Kc - 1 layer inputs it saw (its conv tail). Both depend on the span's tokens only, so one entry per
span serves every request at any offset. A PDEP segment enters each layer with the state of the
recurrence run over all earlier segments: the maps applied in order to the state before them, and
the conv window shifted by each tail (docs/DESIGN.md section 5). `entry_states` does that on device,
in the compose program before the step: per position one gather from the pool and one batched
matmul over the rows whose chain still runs, or (chain_compose.use_kernel: asked for, or on a GPU
at a tensor-core precision) one Triton kernel pass per chain, its maps read from the pool by slot
(serving/hybrid/chain_compose.py).

Shape letters: P pool slots, Lg GDN layers, S sequences, L maps per sequence (padded with -1),
Hv/Dk/Dv delta heads and dims, C conv channels, K1 = Kc - 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta.api import FROM_CHECKPOINT, FROM_SLOT, FROM_ZERO, NO_WRITE
from serving.hybrid import chain_compose
from serving.tiers.offload import HostBatch

# The dtype of cached maps' A and B (was Config.span_map_dtype, which nothing ever set): float32.
# A chain composes its maps by matmuls (A2 A1, A2 B1 + B2), so rounding adds up along it; the
# warm path is tested bit-for-bit in float32 against the float64 reference, never in bfloat16.
STATE_DTYPE = jnp.float32
# The compose program's chain kernel on the state cache in place (chain_compose.compose_in_place,
# session 29); False: the rows' states read out, composed and scattered back (53 kernels, 1.05
# ms on an H100 at rag's 16 seats; the same bits). benchmarks/span_compose_cost.py times both.
# Its compiled tests pass on an H100 (bit for bit the other form, s29d); its time is owed:
# `benchmarks/history/scripts/s29c_device.sh` runs rag's compose program in both forms.
COMPOSE_IN_PLACE = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpanMapPool:
    a: jax.Array  # [P, Lg, Hv, Dk, Dk] transition (state dtype)
    b: jax.Array  # [P, Lg, Hv, Dk, Dv] state the span leaves from zero (state dtype)
    tail: jax.Array  # [P, Lg, C, K1] last K1 layer inputs, right-aligned, zeros before (conv dtype)
    count: jax.Array  # [P] int32 the span's non-pad tokens (a span shorter than K1 shifts less)
    # [P, Lg, Hv] bool: that layer's and head's A is exactly zero (the span's decay underflowed),
    # so the head leaves the span in state B whatever it entered with: a chain starts there
    # (chain_compose.reset_starts). False is always safe (the map is applied).
    zero_a: jax.Array


def pool_axes(cache_axes) -> SpanMapPool:
    """Logical axes of the pool (serving/step/sharding.py places it by them), from the cache's
    (the family's `cache_axes`, conv [slots, C, K1], delta [slots, Hv, Dk, Dv]): maps split as
    the delta state they act on (by its heads axis), tails as the conv state they shift."""
    _, heads, *_ = cache_axes.delta[0]
    _, channels, _ = cache_axes.conv[0]
    per_head = ("slots", None, heads, None, None)
    return SpanMapPool(a=per_head, b=per_head, tail=("slots", None, channels, None),
                       count=("slots",), zero_a=("slots", None, heads))


def map_nbytes(hv, dk, dv, conv_channels, k1, gdn_layers, *, state_dtype=jnp.float32,
               conv_dtype=jnp.float32) -> dict:
    """Exact bytes of one cached span (all GDN layers), as the pool holds it."""
    st, cv = jnp.dtype(state_dtype).itemsize, jnp.dtype(conv_dtype).itemsize
    per_layer = dict(a=hv * dk * dk * st, b=hv * dk * dv * st, tail=conv_channels * k1 * cv)
    layer = sum(per_layer.values())
    return dict(per_layer, per_layer_total=layer, layers=gdn_layers, total=gdn_layers * layer + 4)


def allocate(slots, gdn_layers, hv, dk, dv, conv_channels, k1, *, state_dtype=jnp.float32,
             conv_dtype=jnp.float32) -> SpanMapPool:
    """A zeroed pool of `slots` span maps."""
    return SpanMapPool(a=jnp.zeros((slots, gdn_layers, hv, dk, dk), state_dtype),
                       b=jnp.zeros((slots, gdn_layers, hv, dk, dv), state_dtype),
                       tail=jnp.zeros((slots, gdn_layers, conv_channels, k1), conv_dtype),
                       count=jnp.zeros((slots,), jnp.int32),
                       zero_a=jnp.zeros((slots, gdn_layers, hv), bool))


def pool_of(a, b, tail, count) -> SpanMapPool:
    """A pool holding these maps (slot-major: a [P, Lg, Hv, Dk, Dk], ...), its zero_a flags
    read off a (benchmarks and tests build pools this way)."""
    return SpanMapPool(a=a, b=b, tail=tail, count=count,
                       zero_a=jnp.all(jnp.asarray(a) == 0, axis=(-2, -1)))


# How a warm step stores its captured maps (A/B'd by benchmarks/span_step_work.py's forms):
# STORE_STACKED stacks each field over the GDN layers and scatters it once (on an H200 the stack
# of A and B was a 0.69 ms copy of a 14 ms step, session 23); off, each layer's maps are
# scattered straight into their layer of the pool. ZERO_FLAGS off writes the stored slots'
# zero_a as False (safe: their chains then apply every map).
STORE_STACKED = False
# ... or only the small fields stacked (the conv tails, [Lg, S, C, Kc-1], and the zero flags):
# one scatter each where a capturing step ran one a layer (H100, session 36: the store's
# scatters were 83 of a warm step's 102, 0.24 ms busy), A and B still scattered per layer (their
# stack was the copy above). On since session 37 (H100, rag's capturing step: 796 -> 745
# kernels, busy 8.48 -> 8.40 ms; its wall time 9.89 vs 10.05 ms within the run's +-0.15 ms).
STORE_SMALL_STACKED = True
ZERO_FLAGS = True


def store(pool: SpanMapPool, slot, a, b, tail, count) -> SpanMapPool:
    """Write the maps of S spans into their slots (slot [S] int32, -1 = skip).

    a, b, tail: per GDN layer (a sequence of Lg arrays, or one array with the layers first)
    a [S, Hv, Dk, Dk], b [S, Hv, Dk, Dv], tail [S, C, K1], as the model returns them; count [S].
    Each layer's maps go to (slot, layer) straight from the model's arrays: no transposed or
    stacked copy (a warm step stores MAX_CAPTURES maps of every GDN layer, captured or not: 151
    MB of A for Qwen3.5-0.8B). Each map's zero_a flags are read off its A.
    The pool is written after every read of it in the step (the layers read their entries'
    maps; each layer's maps here depend on them): without that order XLA copied the whole pool's
    A and B to keep the reads safe (2 x 302 MiB a warm step at rag's 16 slots, ~0.4 ms on an H100)."""
    pool, a, b, tail = jax.lax.optimization_barrier((pool, tuple(a), tuple(b), tuple(tail)))
    p, lg = pool.a.shape[0], len(a)
    dest = jnp.where(slot >= 0, slot, p)  # out of range: dropped
    zero = [jnp.all(x == 0, axis=(-2, -1)) if ZERO_FLAGS else jnp.zeros(x.shape[:2], bool)
            for x in a]
    count = pool.count.at[dest].set(count.astype(pool.count.dtype), mode="drop")

    def per_layer(buf, x):
        for i in range(lg):
            buf = buf.at[dest, i].set(x[i].astype(buf.dtype), mode="drop")
        return buf

    def stacked(buf, x):
        layer = jnp.arange(lg, dtype=jnp.int32)[:, None]
        return buf.at[dest[None, :], layer].set(jnp.stack(x).astype(buf.dtype), mode="drop")
    big = stacked if STORE_STACKED else per_layer
    small = stacked if STORE_STACKED or STORE_SMALL_STACKED else per_layer
    return SpanMapPool(a=big(pool.a, a), b=big(pool.b, b), tail=small(pool.tail, tail),
                       count=count, zero_a=small(pool.zero_a, zero))


def chain_lengths(slots):
    """[S] int32 maps in each chain of slots [S, L] (a chain ends at its first -1)."""
    return jnp.sum(jnp.cumprod(slots >= 0, axis=1), axis=1).astype(jnp.int32)


def _longest_first(n_maps):
    """The row order that sorts chains longest first (stable: equal lengths keep their order)."""
    return jnp.argsort(-n_maps, stable=True)


def _compose(pool, chains, n_maps, conv0, delta0, precision, impl="auto"):
    """The chains composed on states in the cache's layout ([Lg, S, ...]): the Triton kernel
    (chain_compose.use_kernel; any row order), else chain_compose.compose_sorted (rows sorted
    longest first)."""
    if chain_compose.use_kernel(impl, precision):
        return chain_compose.compose_kernel(pool, chains, n_maps, conv0,
                                            delta0.astype(jnp.float32), precision)
    conv, delta = chain_compose.compose_sorted(
        pool, chains, n_maps, jnp.moveaxis(conv0, 1, 0),
        jnp.moveaxis(delta0.astype(jnp.float32), 1, 0), precision)
    return jnp.moveaxis(conv, 0, 1), jnp.moveaxis(delta, 0, 1)


def entry_states(pool: SpanMapPool, slots, conv0, delta0, *, precision=None, impl="auto"):
    """Entry states of S segments, each after its chain of cached spans.

    Args:
      pool: the span maps.
      slots: [S, L] int32 pool slots in order (the first map runs first); -1 ends a chain.
      conv0: [Lg, S, C, K1] conv windows before the chain; delta0: [Lg, S, Hv, Dk, Dv] float32.
      precision: of the composition's dots (affine.compose_precision; None: IEEE float32).
      impl: chain_compose.IMPLS ("auto": the Triton kernel on a GPU at a tensor-core precision,
        else the XLA loop: chain_compose.use_kernel).
    Returns:
      conv [Lg, S, C, K1] (conv0's dtype), delta [Lg, S, Hv, Dk, Dv] float32.

    The kernel takes the rows as they are (chain_compose.compose_kernel). For the XLA loop rows
    are sorted longest chain first, then composed by chain_compose.compose_sorted: per
    chain position one gather of that position's maps and one batched matmul, over the rows
    whose chain is still running (rounded up to a static width), so ended chains and the
    padding of L cost nothing and no [S, L] gather of whole maps is ever materialised.
    """
    n_maps = chain_lengths(slots)
    if chain_compose.use_kernel(impl, precision):
        return _compose(pool, slots, n_maps, conv0, delta0, precision, impl)
    order = _longest_first(n_maps)
    conv, delta = _compose(pool, slots[order], n_maps[order], conv0[:, order], delta0[:, order],
                           precision, impl)
    back = jnp.argsort(order)
    return conv[:, back], delta[:, back]


def enter(family, cache, pool: SpanMapPool, state_slots, reset, chain_seq, chains, *,
          precision=None, restore=None):
    """Before the model runs (the compose program, serving/hybrid/span_compose.py): the state
    slot of each sequence with a chain of cached spans moves on by it, from zero where that
    sequence resets.

    state_slots, reset: [S] the step's sequences; chain_seq: [Sc] int32 which sequence each
    chain row is (-1 = none; at most one row per sequence: rows write their sequence's slot);
    chains: [Sc, L] pool slots in order (-1 ends a chain);
    precision: entry_states'; restore: None, or (the checkpoint pool, [Sc] int32 checkpoint
    slot per chain row, -1 = none): a row with a slot starts from that checkpoint instead of its
    state slot (a resume at c comes before the spans skipped right after c); it is written once,
    with the chain's result (restoring first wrote every restored state into the cache and read
    it back: two scatters per GDN layer more).
    Where the chain kernel composes (chain_compose.use_kernel) and the family hands out its
    layers' state caches (`state_layers`), the kernel moves the slots on in place
    (chain_compose.compose_in_place: no stacked copy of the rows' states, no scatter back);
    else the rows' states are read, composed (`_compose`) and written back.
    Returns (cache, reset [S] off for the sequences that entered: their slot holds the entry
    state now)."""
    n_seqs = state_slots.shape[0]
    n_maps = chain_lengths(chains)
    ck, ck_slot = restore if restore is not None else (None, None)
    if COMPOSE_IN_PLACE and chain_compose.use_kernel("auto", precision) and \
            hasattr(family, "state_layers"):
        cache = _enter_in_place(family, cache, pool, state_slots, reset, chain_seq, chains,
                                n_maps, ck, ck_slot, precision)
    else:
        order = _longest_first(n_maps)  # rows reordered before the states are read
        cache = _enter_read_write(family, cache, pool, state_slots, reset, chain_seq[order],
                                  chains[order], n_maps[order], ck,
                                  None if ck is None else ck_slot[order], precision)
    entering = (chain_seq >= 0) & (n_maps > 0)
    entered = jnp.zeros(n_seqs, bool).at[jnp.where(entering, chain_seq, n_seqs)].set(
        True, mode="drop")
    return cache, reset & ~entered


def _rows(state_slots, reset, chain_seq, n_maps, ck_slot):
    """Per chain row: (its state slot, whether its slot is written, restored from a checkpoint,
    kept (not reset))."""
    rows = jnp.clip(chain_seq, 0, state_slots.shape[0] - 1)
    entering = (chain_seq >= 0) & (n_maps > 0)
    # a row of no sequence writes nothing, a restore slot notwithstanding (it would write
    # sequence 0's slot: the compose program's padding rows never hold one)
    restored = jnp.zeros_like(entering) if ck_slot is None else (ck_slot >= 0) & (chain_seq >= 0)
    # a restored row without maps keeps its checkpoint
    return state_slots[rows], entering | restored, restored, ~reset[rows]


def _windows0(conv0, ck, ck_slot, restored, keep):
    """The rows' conv windows before their chains [Lg, Sc, C, K1]: the slot's, a restored row's
    checkpoint's, zeros on a reset."""
    if ck is not None:
        conv0 = jnp.where(restored[None, :, None, None],
                          ck.conv[:, jnp.maximum(ck_slot, 0)].astype(conv0.dtype), conv0)
    return jnp.where(keep[None, :, None, None], conv0, 0).astype(conv0.dtype)


def _enter_in_place(family, cache, pool, state_slots, reset, chain_seq, chains, n_maps, ck,
                    ck_slot, precision):
    """enter by the chain kernel on the family's state caches (rows in any order)."""
    slots, written, restored, keep = _rows(state_slots, reset, chain_seq, n_maps, ck_slot)
    conv_layers, delta_layers = family.state_layers(cache)
    conv0 = _windows0(jnp.stack([c[slots] for c in conv_layers]), ck, ck_slot, restored, keep)
    source = jnp.where(~written, NO_WRITE, jnp.where(
        ~keep, FROM_ZERO, jnp.where(restored, FROM_CHECKPOINT, FROM_SLOT)))
    convs, deltas = chain_compose.compose_in_place(
        pool, chains, n_maps, slots, source, conv_layers, delta_layers,
        chain_compose.chain_window(pool, chains, n_maps, conv0),
        ck_delta=None if ck is None else ck.delta, ck_slots=ck_slot, precision=precision)
    return family.with_state_layers(cache, convs, deltas)


def _enter_read_write(family, cache, pool, state_slots, reset, chain_seq, chains, n_maps, ck,
                      ck_slot, precision):
    """enter by reading the rows' states out, composing them (`_compose`; rows sorted longest
    chain first) and writing them back."""
    slots, written, restored, keep = _rows(state_slots, reset, chain_seq, n_maps, ck_slot)
    conv0, delta0 = family.read_states(cache, slots)  # [Lg, Sc, ...]
    conv0 = _windows0(conv0, ck, ck_slot, restored, keep)
    if ck is not None:
        delta0 = jnp.where(restored[None, :, None, None, None],
                           ck.delta[:, jnp.maximum(ck_slot, 0)].astype(delta0.dtype), delta0)
    delta0 = jnp.where(keep[None, :, None, None, None], delta0, 0.0)
    conv, delta = _compose(pool, chains, n_maps, conv0, delta0, precision)
    return family.write_states(cache, slots, conv, delta, written)


# -- host tier: whole slots move out (an evicted map kept on the host) and back in ------------

def _bucket(n: int) -> int:
    return max(4, 1 << (n - 1).bit_length())


@jax.jit
def _gather(pool, ids):
    return [getattr(pool, f.name)[ids] for f in dataclasses.fields(pool)]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(pool, ids, *rows):
    return SpanMapPool(*(getattr(pool, f.name).at[ids].set(x, mode="drop")
                         for f, x in zip(dataclasses.fields(pool), rows)))


def apply_moves(pool: SpanMapPool, moves_out, moves_in) -> SpanMapPool:
    """Carry out the map store's moves of a step ((slot, entry) lists, serving/hybrid/checkpoint_store.py
    bookkeeping): gather the evicted slots to the host, then scatter host entries into theirs."""
    if moves_out:
        ids = np.zeros(_bucket(len(moves_out)), np.int32)
        ids[:len(moves_out)] = [s for s, _ in moves_out]
        batch = HostBatch(_gather(pool, jnp.asarray(ids)))
        for row, (_, e) in enumerate(moves_out):
            e.host = (batch, row)
    if moves_in:
        n = _bucket(len(moves_in))
        ids = np.full(n, pool.a.shape[0], np.int32)  # out of range rows are dropped
        ids[:len(moves_in)] = [s for s, _ in moves_in]
        fields = [getattr(pool, f.name) for f in dataclasses.fields(pool)]
        rows = [np.zeros((n,) + x.shape[1:], x.dtype) for x in fields]
        for k, (_, e) in enumerate(moves_in):
            batch, row = e.host
            for dst, src in zip(rows, batch.materialize()):
                dst[k] = src[row]
            e.host = None
        pool = _scatter(pool, jnp.asarray(ids), *(jnp.asarray(r) for r in rows))
    return pool
