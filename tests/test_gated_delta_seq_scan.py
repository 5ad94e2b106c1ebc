"""The ragged scan kernel's per-sequence programs (ragged_triton.SEQ_PARALLEL: the sequences of a
step run side by side) against the serial scan (one program walks every packed chunk): the same
outputs, finals and checkpoints bit for bit, on batches with shifted starts, empty sequences,
one-token rows, bucket padding, and checkpoints at chunk boundaries and sequence ends (remapped
initial states: tests/test_span_joint_layer.py). Interpret mode on CPU; `MINIPIC_COMPILED=1`
compiles both on a GPU (the switch is part of the compiled call's jit key: the last test)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from jaxpr_walk import outer_eqns
from kernels_pallas.gated_delta import (api, fused_triton, ragged, ragged_triton, reference,
                                        stream_pack)

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _run(monkeypatch, seq_parallel, args, **kw):
    monkeypatch.setattr(ragged_triton, "SEQ_PARALLEL", seq_parallel)
    fn = jax.jit(lambda *a: api.ragged_gated_delta(
        *a, implementation="pallas_fused", interpret=INTERPRET, decode=False, **kw))
    return [np.asarray(x) for x in fn(*args)]


@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_per_sequence_scan_equals_the_serial_scan_bit_for_bit(fresh_rng, monkeypatch, layout):
    hk, hv, dk, dv, chunk = 1, 2, 16, 16, 16
    lens, pos0 = [20, 0, 5, 37, 16, 1], [3, 0, 16, 0, 32, 7]  # shifted, empty, one-token rows
    t = sum(lens) + 7  # bucket padding rows
    q, k, v, g, beta = (x[0] for x in gdn_inputs(fresh_rng, 1, t, hk, hv, dk, dv))
    s0 = fresh_rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ends = np.array(pos0) + np.array(lens)
    ck = np.stack([ends, [16, -1, 16, 32, 48, -1]], axis=1).astype(np.int32)
    args = (q, k, v, g, beta, cu, np.array(pos0, np.int32), s0)
    monkeypatch.setitem(fused_triton.DEFAULTS, "layout", layout)  # read at each call
    kw = dict(checkpoint_at=jnp.asarray(ck), chunk=chunk)
    serial = _run(monkeypatch, False, args, **kw)
    side_by_side = _run(monkeypatch, True, args, **kw)
    for name, a, b in zip(("out", "final", "checkpoints"), serial, side_by_side):
        np.testing.assert_array_equal(b, a, err_msg=name)
    out, fin = side_by_side[:2]
    for s in range(len(lens)):  # and both are the recurrence (so neither can be garbage alike)
        a, e = cu[s], cu[s + 1]
        if a == e:
            np.testing.assert_array_equal(fin[s], s0[s])
            continue
        ro, rs = reference.gated_delta_reference(q[None, a:e], k[None, a:e], v[None, a:e],
                                                 g[None, a:e], beta[None, a:e], s0[s:s + 1])
        np.testing.assert_allclose(out[a:e], ro[0], atol=2e-5, err_msg=f"sequence {s}")
        np.testing.assert_allclose(fin[s], rs[0, -1], atol=2e-5, err_msg=f"sequence {s}")


def test_per_sequence_scan_runs_one_program_per_sequence(monkeypatch):
    """The scan's grid gains a sequence axis (the sequences of a step side by side) only with
    SEQ_PARALLEL; the intra-chunk and output kernels are the same either way."""
    rng = np.random.default_rng(0)
    q, k, v, g, beta = (x[0] for x in gdn_inputs(rng, 1, 40, 1, 2, 16, 16))
    args = (q, k, v, g, beta, np.array([0, 10, 25, 40], np.int32), np.zeros(3, np.int32),
            np.zeros((3, 2, 16, 16), np.float32))
    grids = {}
    for flag in (False, True):
        monkeypatch.setattr(ragged_triton, "SEQ_PARALLEL", flag)
        jaxpr = jax.make_jaxpr(lambda *a: api.ragged_gated_delta(
            *a, chunk=16, implementation="pallas_fused", interpret=True, decode=False))(*args)
        grids[flag] = [tuple(e.params["grid_mapping"].grid) for e in outer_eqns(jaxpr.jaxpr)
                       if e.primitive.name == "pallas_call"
                       and e.params["name"] != stream_pack.NAME]  # (the stream's gather)
    assert len(grids[True]) == len(grids[False]) == 3  # intra, scan, output
    changed = [(a, b) for a, b in zip(grids[False], grids[True]) if a != b]
    assert changed == [((2, 1), (2, 1, 3))]  # the scan: heads x value blocks (x 3 sequences)


def test_the_switch_and_the_layout_are_part_of_the_compiled_calls_key(monkeypatch):
    """The compiled path runs the kernels under one module-level jit (ragged._packed_once): a
    switch flipped between two calls of the same shapes must give a new trace, not the first
    one's (else a GPU A/B compares a kernel with itself). Traced without lowering: CPU is fine."""
    rng = np.random.default_rng(0)
    q, k, v, g, beta = (x[0] for x in gdn_inputs(rng, 1, 40, 1, 2, 16, 16))
    args = (q, k, v, g, beta, np.array([0, 10, 25, 40], np.int32), np.zeros(3, np.int32),
            np.zeros((3, 2, 16, 16), np.float32))

    def scan_grid():
        jaxpr = jax.make_jaxpr(lambda *a: ragged.ragged_prefill(  # below api's GPU check
            *a, chunk=16, implementation="pallas_fused", interpret=False))(*args)
        calls = [e for e in outer_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"
                 and e.params["name"] != stream_pack.NAME]
        return [tuple(e.params["grid_mapping"].grid) for e in calls][1]  # intra, scan, output

    for first in (True, False):
        grids = {}
        for flag in (first, not first):
            monkeypatch.setattr(ragged_triton, "SEQ_PARALLEL", flag)
            grids[flag] = scan_grid()
        assert grids == {True: (2, 1, 3), False: (2, 1)}


def test_a_step_of_many_sequences_scans_wide_value_blocks_with_the_same_results(fresh_rng,
                                                                                monkeypatch):
    """ragged.scan_block_v: 16 sequences (the step's bucket) scan WIDE_BLOCK_V columns a program,
    8 keep DEFAULTS' block; at Dv = 64 the wide scan gives the narrow one's outputs, finals and
    checkpoints (bit for bit interpreted; a compiled dot of another tile may sum otherwise) and
    the recurrence's."""
    hk, hv, dk, dv, chunk = 1, 2, 16, 64, 16
    lens = [int(x) for x in fresh_rng.integers(0, 24, 16)]
    pos0 = [int(x) for x in fresh_rng.integers(0, 40, 16)]
    t = sum(lens) + 5
    q, k, v, g, beta = (x[0] for x in gdn_inputs(fresh_rng, 1, t, hk, hv, dk, dv))
    s0 = fresh_rng.standard_normal((16, hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pk = ragged.packing(jnp.asarray(cu), jnp.asarray(pos0, jnp.int32), t, chunk=chunk)
    assert ragged.scan_block_v(pk) == ragged.WIDE_BLOCK_V == 64
    assert ragged.scan_block_v(ragged.packing(jnp.asarray(cu[:9]), jnp.asarray(pos0[:8]), t,
                                              chunk=chunk)) is None
    seen = []
    real = ragged_triton.packed_gated_delta
    monkeypatch.setattr(ragged_triton, "packed_gated_delta",
                        lambda *a, **kw: seen.append(kw.get("block_v")) or real(*a, **kw))
    args = (q, k, v, g, beta, cu, np.array(pos0, np.int32), s0)
    kw = dict(checkpoint_at=jnp.asarray(np.array(pos0) + np.array(lens))[:, None], chunk=chunk)
    wide = _run(monkeypatch, True, args, **kw)
    monkeypatch.setattr(ragged, "SCAN_BLOCK_V", 16)
    narrow = _run(monkeypatch, True, args, **kw)
    assert seen == [64, 16], seen
    for name, a, b in zip(("out", "final", "checkpoints"), narrow, wide):
        if INTERPRET:
            np.testing.assert_array_equal(b, a, err_msg=name)
        else:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=name)
    for s in np.flatnonzero(np.diff(cu)):
        a, e = cu[s], cu[s + 1]
        _, rs = reference.gated_delta_reference(q[None, a:e], k[None, a:e], v[None, a:e],
                                                g[None, a:e], beta[None, a:e], s0[s:s + 1])
        np.testing.assert_allclose(wide[1][s], rs[0, -1], atol=2e-5, err_msg=f"sequence {s}")
