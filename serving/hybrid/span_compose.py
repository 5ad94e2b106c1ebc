"""Composing cached span maps in a program of its own, dispatched right before the step that needs
it (issue 29, "no stalls").

A sequence that skips cached spans enters the step with its recurrent state moved on by their
maps (span_maps.entry_states). That used to happen inside the warm span step, so every step
variant had one more static shape, the chain rows [Sc, L]: per token bucket and attention plan
one span variant per row bucket (at 64 seats and 1,024 tokens per step, 22 span variants, each a
whole model compile). Here it is a small program keyed only by (rows, length): no model, no
attention, shared by every token bucket, so warm-up readies len(warm_chains(seats)) of them (1 at
4 seats, 3 at 16, 5 at 64) next to one span variant per token bucket and plan.

Inputs: one packed int32 buffer (`layout`): per chain row the sequence's state slot, its reset
flag, the checkpoint its state is restored from (with a checkpoint pool; a resume at c comes
before the spans skipped right after c, so the restore moves here too) and its chain of map-pool
slots. The host then clears those sequences' reset and restore in the step's own inputs
(`fill`): their slots hold the entry state when the step runs, as they did when the step
composed them itself, so outputs are the same bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta.api import compose_precision
from serving.hybrid import span_step


@functools.lru_cache(maxsize=None)
def layout(rows: int, length: int, ckpt: bool) -> tuple[dict, int]:
    """Static offsets of the compose program's fields in its int32 buffer."""
    fields = [("slot", (rows,)), ("reset", (rows,))] + ([("restore", (rows,))] if ckpt else []) \
        + [("chain", (rows, length))]
    spec, off = {}, 0
    for name, shape in fields:
        spec[name] = (off, shape)
        off += int(np.prod(shape))
    return spec, off


def shape(batch, max_seqs: int, length: int) -> tuple:
    """(rows, length) of the step's compose program, () when no sequence enters with cached
    maps. Rows are bucketed against the engine's largest step (`max_seqs`), not this step's
    sequence bucket, so every token bucket shares the same few programs."""
    if not any(e.map_chain for e in batch):
        return ()
    return span_step.chain_shape(batch, max_seqs, length)


def warm_shapes(max_seqs: int, length: int) -> list[tuple[int, int]]:
    """Every (rows, length) a step of this engine can need: warm-up readies each."""
    return span_step.warm_chains(max_seqs, length)


def empty(ints: np.ndarray, spec: dict, scratch_slot: int) -> None:
    """Padding rows: the scratch state slot, no chain, no restore (nothing is written)."""
    for name, fill in (("slot", scratch_slot), ("reset", 0), ("restore", -1), ("chain", -1)):
        if name in spec:
            o, shp = spec[name]
            ints[o:o + int(np.prod(shp))] = fill


def fill(batch, v: dict, cv: dict) -> None:
    """The compose inputs `cv` of a step whose inputs are `v` (filled: state_slots, reset, the
    restore rows restore_seq / restore_slot); the sequences that enter with cached maps lose their
    reset and restore row in `v` (the compose program does both before the step runs)."""
    c = 0
    for i, e in enumerate(batch):
        if not e.map_chain:
            continue
        cv["slot"][c] = v["state_slots"][i]
        cv["reset"][c] = v["reset"][i]
        cv["chain"][c, :len(e.map_chain)] = e.map_chain
        v["reset"][i] = 0
        if "restore" in cv:  # the step's restores are flat rows (step_inputs.fill_checkpoints)
            row = np.flatnonzero((v["restore_seq"] == i) & (v["restore_slot"] >= 0))
            cv["restore"][c] = v["restore_slot"][row[0]] if row.size else -1
            v["restore_seq"][row], v["restore_slot"][row] = -1, -1
        c += 1


def program(family, cache, ck_pool, maps, ints, rows: int, length: int, *,
            precision: str = "highest"):
    """On device: restore the chain rows' checkpoints (ck_pool: the checkpoint pool or None),
    then compose each row's chain onto its state (span_step.enter on the rows alone), its dots
    at `precision` (a name of affine.COMPOSE_PRECISIONS). Returns the cache."""
    spec, _ = layout(rows, length, ck_pool is not None)
    f = {k: jax.lax.dynamic_slice_in_dim(ints, o, int(np.prod(shp))).reshape(shp)
         for k, (o, shp) in spec.items()}
    fields = dict(state_slots=f["slot"], chain_seq=jnp.arange(rows, dtype=jnp.int32),
                  chain=f["chain"])
    if ck_pool is not None:
        fields["restore_slot"] = f["restore"]
    cache, _, _ = span_step.enter(family, cache, ck_pool, maps, fields, f["reset"] > 0,
                                  precision=compose_precision(precision))
    return cache


def static(rows: int, length: int) -> dict:
    """The compose program's static step arguments (the step's own ones fixed: one program per
    (rows, length) whatever the step it precedes)."""
    return dict(t=0, s=0, all_greedy=True, use_filter=False, num_logprobs=0,
                compose=(rows, length))


class ComposeInputs:
    """The host side: buffers per (rows, parity), filled per step; the warm-up's empty calls.

    max_seqs: the sequences of the engine's largest step; length: its chain length
    (span_step.chain_length); scratch_slot: the state slot padding rows name; precision: the
    programs' (Config.span_maps.compose_precision)."""

    def __init__(self, max_seqs: int, length: int, scratch_slot: int,
                 precision: str = "highest"):
        self.max_seqs, self.length, self.scratch_slot = max_seqs, length, scratch_slot
        self.precision = precision
        self._bufs: dict = {}

    def _buffer(self, rows: int, length: int, ckpt: bool, parity: int):
        key = (rows, length, ckpt, parity)  # async: a set per parity (one step in flight)
        if key not in self._bufs:
            spec, size = layout(rows, length, ckpt)
            ints = np.zeros(size, np.int32)
            self._bufs[key] = (ints, spec, {k: ints[o:o + int(np.prod(shp))].reshape(shp)
                                            for k, (o, shp) in spec.items()})
        return self._bufs[key]

    def build(self, batch, v: dict, parity: int = 0):
        """(ints, static kwargs) of the program composing this step's chains, or None when no
        sequence enters with cached maps; clears their reset / restore in `v` (see `fill`)."""
        chain = shape(batch, self.max_seqs, self.length)
        if not chain:
            return None
        ints, spec, cv = self._buffer(*chain, "restore_slot" in v, parity)
        empty(ints, spec, self.scratch_slot)
        fill(batch, v, cv)
        return ints, static(*chain)

    def warmup_steps(self, ckpt: bool) -> list:
        """(ints, floats, static kwargs) of an empty call of every compose program."""
        steps = []
        for rows, length in warm_shapes(self.max_seqs, self.length):
            ints, spec, _ = self._buffer(rows, length, ckpt, 0)
            empty(ints, spec, self.scratch_slot)
            steps.append((ints.copy(), None, static(rows, length)))
        return steps
