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
