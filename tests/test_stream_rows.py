"""The ragged GDN kernels read their packed stream through its source rows (stream_rows.py:
`STREAM_IN_KERNEL`, no XLA gather of the worst-case stream first): the same outputs, finals and
checkpoints bit for bit as with the stream gathered, on a ragged batch (shifted starts, empty
sequences, one-token rows, bucket padding, GVA heads) and on a span step's joint stream (its
transition rows read v as zeros through `src_v`, entries, captures). Interpret mode on CPU;
`MINIPIC_COMPILED=1` compiles the kernels on a GPU (there within float32 summation order)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from kernels_pallas.gated_delta import api, stream_rows
from kernels_pallas.gated_delta.api import CheckpointRows
from minipic_jax.models import qwen3_5_gdn, qwen3_5_spans

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _equal(a, b, name):
    if INTERPRET:
        np.testing.assert_array_equal(b, a, err_msg=name)
    else:
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=name)


def both_forms(monkeypatch, module, name, fn):
    """fn()'s outputs (numpy, None kept) with module.<name> False, then True."""
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(module, name, flag)
        # a new function each time: jax.jit caches a trace by the function, and the switch is
        # read when it traces
        out[flag] = [None if x is None else np.asarray(x) for x in jax.jit(lambda: fn())()]
    return out[False], out[True]


RAGGED_OUTPUTS = ("out", "final", "checkpoints")
JOINT_OUTPUTS = ("core", "delta", "checkpoints", "local finals", "transitions")


def ragged_case(rng):
    """(fn, rows): a ragged batch (shifted starts, empty sequences, one-token rows, bucket
    padding, GVA heads, checkpoints) through the kernels of api.ragged_gated_delta; rows used."""
    hk, hv, dk, dv, chunk = 1, 2, 16, 16, 16
    lens, pos0 = [20, 0, 5, 37, 16, 1], [3, 0, 16, 0, 32, 7]
    t = sum(lens) + 7  # bucket padding rows
    x = tuple(a[0] for a in gdn_inputs(rng, 1, t, hk, hv, dk, dv))
    s0 = rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ends = np.array(pos0) + np.array(lens)
    ck = np.stack([ends, [16, -1, 16, 32, 48, -1]], axis=1).astype(np.int32)

    def fn():
        return api.ragged_gated_delta(*x, cu, np.array(pos0, np.int32), s0,
                                      checkpoint_at=jnp.asarray(ck), chunk=chunk,
                                      implementation="pallas_fused", interpret=INTERPRET,
                                      decode=False)
    return fn, int(cu[-1])


def joint_case(rng, case):
    """(fn, rows, plan): a span step's joint stream (test_span_joint_layer.CASES[case], with
    checkpoints) through the kernels of qwen3_5_gdn.recurrent_core; rows used; its plan."""
    import test_span_joint_layer as t
    lens, pos0, g, caps, cont, local_chunks = t.CASES[case]
    pieces = t._pieces(rng, lens, g, caps, cont, local_chunks)
    x = tuple(jnp.asarray(a[0]) for a in gdn_inputs(rng, 1, t.T, t.HK, t.HV, t.DK, t.DV))
    delta0 = jnp.asarray(rng.standard_normal((len(lens), t.HV, t.DK, t.DV)), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    p0 = jnp.asarray(pos0, jnp.int32)
    ends = np.asarray(pos0) + np.asarray(lens)
    ck = CheckpointRows(seq=jnp.asarray(np.repeat(np.arange(len(lens)), 2), jnp.int32),
                        pos=jnp.asarray(np.stack([ends, (np.asarray(pos0) // t.CHUNK + 1)
                                                  * t.CHUNK], 1).reshape(-1), jnp.int32))
    plan = qwen3_5_spans.for_layer(qwen3_5_spans.prepare(pieces, cu, t.T, t.KC, t.CHUNK, p0), 0)

    def fn():
        return qwen3_5_gdn.recurrent_core(x, cu, p0, delta0, plan, checkpoint_at=ck,
                                          decode=False, packing=None,
                                          implementation="pallas_fused", interpret=INTERPRET)
    return fn, int(cu[-1]), plan


def test_ragged_batch_reads_its_source_rows_bit_for_bit(fresh_rng, monkeypatch):
    fn, rows = ragged_case(fresh_rng)
    gathered, in_kernel = both_forms(monkeypatch, stream_rows, "STREAM_IN_KERNEL", fn)
    for name, a, b in zip(RAGGED_OUTPUTS, gathered, in_kernel):
        _equal(a, b, name)
    assert np.abs(in_kernel[0][:rows]).max() > 0


@pytest.mark.parametrize("case", [  # STREAM_IN_KERNEL is off (slower, s28): one case in CI
    "shifted, empty, captures of -1",
    pytest.param("leading empty sequences", marks=pytest.mark.slow)])
def test_joint_stream_reads_its_source_rows_bit_for_bit(fresh_rng, monkeypatch, case):
    fn, rows, _ = joint_case(fresh_rng, case)
    gathered, in_kernel = both_forms(monkeypatch, stream_rows, "STREAM_IN_KERNEL", fn)
    for name, a, b in zip(JOINT_OUTPUTS, gathered, in_kernel):
        assert (a is None) == (b is None), name
        if a is not None:
            _equal(a[:rows] if name == "core" else a, b[:rows] if name == "core" else b, name)
