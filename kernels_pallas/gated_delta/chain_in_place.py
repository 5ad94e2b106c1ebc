"""The chain kernel of chain_triton.py run on the state cache itself (issue 29, "Composition
cost"): each chain row's recurrent states are read from and written back to the GDN layers'
state slots, and their conv windows written there too, in one kernel.

The compose program (serving/hybrid/span_compose.py) used to gather the chain rows' states of
every layer into one stacked array (a [Lg, S, Hv, Dk, Dv] copy: 0.18 ms at rag's 16 seats on an
H100), run chain_triton.chain_apply on it, and scatter conv and delta states back, one scatter per
layer and state (36 kernels of ~6 us at Qwen3.5-0.8B): 53 kernels and 1.05 ms for 0.18 ms of
chain work. Here the cache's per-layer arrays are the kernel's operands, aliased to its outputs:
program (row, layer x head, value block) loads its state block from the row's slot (or from a
checkpoint, or zero), runs the chain by chain_triton's `run_chain` (the same bits), and stores
it in place; the layer is a program id, so each load and store picks its
layer's array through a switch. The programs of a (row, layer) also copy the row's conv window
(computed by the caller in closed form, chain_compose.chain_window) into the layer's conv slot,
in pieces of a power-of-two size. Rows whose source is NO_WRITE touch nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta.chain_triton import launch_options, run_chain

_F32 = jnp.float32
# where a chain row's state comes from before its chain (`source`)
NO_WRITE, FROM_SLOT, FROM_ZERO, FROM_CHECKPOINT = -1, 0, 1, 2
_MAX_PIECE = 4096


def conv_piece(flat: int) -> int:
    """The conv copy's piece: the largest power of two dividing `flat` (C x K1), at most 4,096."""
    return min(flat & -flat, _MAX_PIECE)


def _kernel(chain_ref, n_ref, start_ref, source_ref, slot_ref, ck_slot_ref, a_ref, b_ref,
            ck_ref, window_ref, *refs, layers, heads, block_v, piece, checkpoints, precision,
            interpret):
    # chain [S, L]; n, source, slot, ck_slot [S]; start [S, G]; a [P, Lg, Hv, Dk, Dk], b [P, Lg,
    # Hv, Dk, Dv] (the span-map pool); ck [Lg, Pc, Hv, Dk, Dv] (the checkpoint pool's delta, a
    # dummy without `checkpoints`); window [Lg, S, F] the rows' conv windows flattened (F = C K1);
    # refs: delta_in x Lg [P, Hv, Dk, Dv], conv_in x Lg [P, F], then the same as outputs (aliased)
    delta_out, conv_out = refs[2 * layers:3 * layers], refs[3 * layers:]
    delta_in = refs[:layers]
    r, g, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, head = g // heads, g % heads
    cols = pl.ds(pl.multiple_of(v * block_v, block_v), block_v)
    source, slot = source_ref[r], slot_ref[r]
    dk = b_ref.shape[3]

    @pl.when(source != NO_WRITE)
    def _():
        here = jax.lax.switch(layer, [functools.partial(lambda d: d[slot, head, :, cols], d)
                                      for d in delta_in]).astype(_F32)
        if checkpoints:
            ck = ck_ref[layer, jnp.maximum(ck_slot_ref[r], 0), head, :, cols].astype(_F32)
            here = jnp.where(source == FROM_CHECKPOINT, ck, here)
        s0 = jnp.where(source == FROM_ZERO, jnp.zeros((dk, block_v), _F32), here)
        s = run_chain(s0, r, start_ref[r, g], layer, head, cols, chain_ref, n_ref, a_ref, b_ref,
                      precision, interpret)

        def put(d):
            d[slot, head, :, cols] = s
        jax.lax.switch(layer, [functools.partial(put, d) for d in delta_out])

        # the (row, layer)'s conv window: piece p by the program numbered p mod its programs
        me, programs = head * pl.num_programs(2) + v, heads * pl.num_programs(2)
        pieces = window_ref.shape[2] // piece

        def copy(j, carry):
            at = pl.ds(pl.multiple_of((me + j * programs) * piece, piece), piece)
            w = window_ref[layer, r, at]

            def put_conv(c):
                c[slot, at] = w.astype(c.dtype)
            jax.lax.switch(layer, [functools.partial(put_conv, c) for c in conv_out])
            return carry
        jax.lax.fori_loop(0, (pieces - me + programs - 1) // programs, copy, 0)


def chain_in_place(a, b, chains, n_maps, start, source, slots, deltas, convs, windows, *,
                   ck_delta=None, ck_slots=None, precision=None, block_v: int | None = None,
                   num_warps: int = 8, num_stages: int | None = None, interpret: bool = False):
    """Compose each chain row's maps onto its state slot in place, and write its conv window.

    Args:
      a: [P, Lg, Hv, Dk, Dk], b: [P, Lg, Hv, Dk, Dv] the span-map pool (float32).
      chains: [S, L] int32 pool slots in order; n_maps: [S] int32 maps to apply per row.
      start: [S, Lg, Hv] int32 chain_compose.reset_starts (-1: none).
      source: [S] int32 each row's state before its chain: FROM_SLOT (its slot), FROM_ZERO,
        FROM_CHECKPOINT (ck_delta at ck_slots), or NO_WRITE (the row writes nothing).
      slots: [S] int32 the rows' state slots (distinct among the rows that write: two programs
        writing one slot would race).
      deltas: Lg arrays [P, Hv, Dk, Dv] float32, the GDN layers' state caches.
      convs: Lg arrays [P, C, K1], the conv state caches; windows: [Lg, S, C, K1] the rows' conv
        windows after their chains (written where the row writes).
      ck_delta: None or [Lg, Pc, Hv, Dk, Dv] the checkpoint pool's delta; ck_slots: [S] int32.
      precision, block_v, num_warps, num_stages: as chain_triton.chain_apply.
    Returns:
      (deltas, convs) with the rows' slots moved on (the same buffers, aliased).
    """
    layers = len(deltas)
    if layers == 0 or len(convs) != layers:
        raise ValueError(f"chain_in_place: {layers} delta and {len(convs)} conv layers")
    _, heads, dk, dv = deltas[0].shape
    rows = chains.shape[0]
    block_v, num_stages = launch_options(a, b, (layers, heads, dk, dv), block_v, num_stages,
                                         precision, "chain_in_place")
    conv_shape = convs[0].shape
    if windows.shape != (layers, rows) + conv_shape[1:]:
        raise ValueError(f"chain_in_place: windows {windows.shape} do not fit {rows} rows of "
                         f"conv states {conv_shape} x {layers} layers")
    flat = conv_shape[1] * conv_shape[2]
    if any(d.shape != deltas[0].shape or d.dtype != _F32 for d in deltas):
        raise ValueError(f"chain_in_place: delta caches must be float32 of one shape, got "
                         f"{[(d.shape, str(d.dtype)) for d in deltas]}")
    checkpoints = ck_delta is not None
    if checkpoints and (ck_slots is None or ck_delta.ndim != 5
                        or ck_delta.shape[0] != layers or ck_delta.shape[2:] != (heads, dk, dv)):
        raise ValueError(f"chain_in_place: ck_delta must be [{layers}, Pc, {heads}, {dk}, {dv}] "
                         f"with ck_slots [{rows}], got {ck_delta.shape} and "
                         f"{None if ck_slots is None else ck_slots.shape}")
    if not checkpoints:
        ck_delta, ck_slots = jnp.zeros((1, 1, 1, dk, dv), _F32), jnp.zeros(rows, jnp.int32)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    convs_flat = [c.reshape(c.shape[0], flat) for c in convs]
    ints = [jnp.clip(jnp.asarray(chains, jnp.int32), 0, a.shape[0] - 1),
            jnp.minimum(jnp.asarray(n_maps, jnp.int32), chains.shape[1]),
            jnp.asarray(start, jnp.int32).reshape(rows, layers * heads),
            jnp.asarray(source, jnp.int32), jnp.asarray(slots, jnp.int32),
            jnp.asarray(ck_slots, jnp.int32)]
    operands = ints + [a, b, ck_delta, windows.reshape(layers, rows, flat)] + list(deltas) + \
        convs_flat
    first_state = len(operands) - 2 * layers
    kernel = functools.partial(_kernel, layers=layers, heads=heads, block_v=block_v,
                               piece=conv_piece(flat), checkpoints=checkpoints,
                               precision=precision, interpret=interpret)
    outs = pl.pallas_call(
        kernel, grid=(rows, layers * heads, dv // block_v),
        in_specs=[whole(x) for x in operands],
        out_specs=[whole(x) for x in operands[first_state:]],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands[first_state:]],
        input_output_aliases={first_state + i: i for i in range(2 * layers)},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="span_chain_in_place",
    )(*operands)
    return (tuple(outs[:layers]),
            tuple(c.reshape(conv_shape) for c in outs[layers:]))
