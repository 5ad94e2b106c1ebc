"""A GDN layer's recurrent core with span pieces (qwen3_5_gdn.recurrent_core): the joint stream
(one ragged batch of the flow, the local pieces and the captured pieces' transitions:
minipic_jax/models/qwen3_5_joint.py) against the passes run one after another, on layouts the
model-level test (test_span_joint_pass.py) lacks: shifted first positions, sequences and pieces
across chunks, empty sequences (leading ones too), captures of -1, long-span entries (the local
piece from the entry's B, the transition from its A), checkpoints at sequence ends and chunk
boundaries, and the local stream's static bound. Decays are mild enough that a transition's A is
far from zero (so a wrong initial A shows). With the Pallas kernels the scan's outputs start as
NaN, as a GPU's unwritten memory may: whatever reads a boundary no program wrote shows."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from gdn_inputs import gdn_inputs
from kernels_pallas.gated_delta import seq_scan
from kernels_pallas.gated_delta.api import CheckpointRows, ragged_packing
from minipic_jax.models import qwen3_5_gdn, qwen3_5_spans
from serving.model_contract import SpanPieces

KC, CHUNK, T = 4, 64, 256
# the Pallas kernels interpreted on CPU, compiled on a GPU with MINIPIC_COMPILED=1
PALLAS = "pallas_fused" if os.environ.get("MINIPIC_COMPILED") == "1" else "pallas_fused_interpret"
HK, HV, DK, DV = 1, 2, 16, 16
CASES = {  # name -> (lens, pos0, piece bound G, captures or None, entry use, local_chunks)
    "shifted, empty, captures of -1": ([90, 0, 70, 1, 60], [70, 5, 0, 31, 130], 24,
                                       [1, -1, 3, -1], [True, False, True, False], None),
    "the local stream's bound": ([90, 0, 70, 1, 60], [70, 5, 0, 31, 130], 24,
                                 [1, -1, 3, -1], [True, False, True, False], 12),
    "no capture": ([120, 40, 0, 80], [3, 64, 9, 127], 16, None, None, None),
    "leading empty sequences": ([0, 0, 200, 30], [0, 0, 65, 1], 16, [2, 0], [True, True], None),
}


@pytest.fixture
def nan_scan_outputs(monkeypatch):
    """The ragged scan kernel's outputs start as NaN (aliased inputs), not zeros; an output the
    kernel already aliases to an input (a state cache written in place) keeps its input."""
    def poisoned(kernel, *, grid, in_specs, out_specs, out_shape, input_output_aliases=None,
                 **kw):
        aliases = dict(input_output_aliases or {})
        fresh = [i for i in range(len(out_shape)) if i not in aliases.values()]

        def call(*args):
            fills = [jnp.full(out_shape[i].shape, jnp.nan, out_shape[i].dtype) for i in fresh]
            n_in = len(args)

            def body(*refs):
                return kernel(*refs[:n_in], *refs[n_in + len(fresh):])
            return pl.pallas_call(
                body, grid=grid, in_specs=list(in_specs) + [out_specs[i] for i in fresh],
                out_specs=out_specs, out_shape=out_shape,
                input_output_aliases={**aliases, **{n_in + j: i for j, i in enumerate(fresh)}},
                **kw)(*args, *fills)
        return call
    shim = types.SimpleNamespace(**{n: getattr(pl, n) for n in dir(pl) if not n.startswith("_")})
    shim.pallas_call = poisoned
    monkeypatch.setattr(seq_scan, "pl", shim)


def _pieces(rng, lens, g, caps, cont, local_chunks):
    seg, span, base = [], [], 0
    for n in lens:  # each sequence: PDEP, span, PDEP ... segments at random cuts
        if n == 0:
            continue
        ids = np.zeros(n, int)
        for c in sorted(rng.choice(np.arange(1, n), size=min(2, n - 1), replace=False)):
            ids[c:] += 1
        seg += (ids + base).tolist()
        span += (ids % 2 == 1).tolist()
        base += ids.max() + 1
    p = qwen3_5_spans.pieces_from_segments(np.asarray(seg), T, g, np.asarray(span, bool),
                                           rng.random(len(lens)) < 0.5)
    capture = entry = None
    if caps is not None:
        capture, mc = jnp.asarray(caps, jnp.int32), len(caps)
        conv_c = 2 * HK * DK + HV * DV
        entry = dict(use=jnp.asarray(cont) & (capture >= 0), slot=jnp.arange(mc, dtype=jnp.int32),
                     count=jnp.full(mc, 40, jnp.int32),
                     a=jnp.asarray(0.2 * rng.standard_normal((8, 1, HV, DK, DK)), jnp.float32),
                     b=jnp.asarray(0.2 * rng.standard_normal((8, 1, HV, DK, DV)), jnp.float32),
                     tail=jnp.asarray(rng.standard_normal((8, 1, conv_c, KC - 1)), jnp.float32))
    return SpanPieces(row_span=p.row_span, piece_cu=p.piece_cu, carry_local=p.carry_local,
                      capture=capture, entry=entry, local_chunks=local_chunks)


# each layout once (the kernels where the layout tests them most: entries, the local bound)
@pytest.mark.parametrize("case,impl", [("shifted, empty, captures of -1", PALLAS),
                                       ("the local stream's bound", PALLAS),
                                       ("no capture", "xla")] + [  # slow tier (CI time)
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("shifted, empty, captures of -1", "xla"), ("leading empty sequences", PALLAS)]])
def test_joint_core_equals_the_separate_passes(fresh_rng, nan_scan_outputs, impl, case):
    pieces, x, cu, p0, ck = layer_case(fresh_rng, case)
    delta0 = jnp.asarray(fresh_rng.standard_normal((cu.shape[0] - 1, HV, DK, DV)), jnp.float32)
    kernel = kernel_options(impl)

    def core(*x):  # both forms in one program (one compile)
        out = []
        for joint in (False, True):
            plan = qwen3_5_spans.for_layer(qwen3_5_spans.prepare(
                pieces, cu, T, KC, CHUNK, p0 if joint else None), 0)
            packing = None if joint else ragged_packing(cu, p0, T, chunk=CHUNK)
            out.append(qwen3_5_gdn.recurrent_core(x, cu, p0, delta0, plan, checkpoint_at=ck,
                                                  decode=False, packing=packing, **kernel))
        return out
    outs = [[None if a is None else np.asarray(a) for a in o] for o in jax.jit(core)(*x)]
    assert_outputs_equal(outs[0], outs[1], int(cu[-1]), exact=False,
                         names=("core", "delta", "checkpoints", "local finals", "transitions"))
    if CASES[case][3] is not None:  # transitions far from zero: a wrong initial A would show
        assert np.abs(outs[1][4]).max() > 1e-2


def layer_case(rng, case):
    """A CASES layout's (pieces, x = (q, k, v, g, beta), cu_q_lens, pos0, checkpoint rows at
    each sequence's end and the chunk boundary after its start), random inputs."""
    lens, pos0, g, caps, cont, local_chunks = CASES[case]
    pieces = _pieces(rng, lens, g, caps, cont, local_chunks)
    x = tuple(jnp.asarray(a[0]) for a in gdn_inputs(rng, 1, T, HK, HV, DK, DV))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    ends = np.asarray(pos0) + np.asarray(lens)
    seq = np.repeat(np.arange(len(lens)), 2)
    pos = np.stack([ends, (np.asarray(pos0) // CHUNK + 1) * CHUNK], 1).reshape(-1)
    # none strictly inside a span piece, as the engine asks (serving/hybrid/span_cache.py
    # `_checkpoints`; a flow borrowing a captured piece's chunks is on that piece's chunk grid:
    # qwen3_5_joint.FLOW_BORROWS)
    row = np.asarray(cu)[seq] + pos - np.asarray(pos0)[seq]
    piece_cu, span = np.asarray(pieces.piece_cu), np.asarray(pieces.row_span)
    piece = np.searchsorted(piece_cu, row, side="right") - 1
    inside = (row > piece_cu[np.minimum(piece, piece_cu.size - 1)]) & span[np.minimum(row, T - 1)]
    ck = CheckpointRows(seq=jnp.asarray(seq[~inside], jnp.int32),
                        pos=jnp.asarray(pos[~inside], jnp.int32))
    return pieces, x, cu, jnp.asarray(pos0, jnp.int32), ck


def kernel_options(impl: str) -> dict:
    """recurrent_core's implementation / interpret for a test's impl name."""
    return dict(implementation=impl.removesuffix("_interpret"),
                interpret=impl.endswith("_interpret"))


# Two forms of the same arithmetic in different kernels: bit for bit interpreted on CPU; compiled,
# Triton may order a dot's float32 sums differently per kernel (an H100 put a transition product
# of cancelling terms 1.3e-4 relative, 7.8e-15 absolute, from the in-stream pass's: session 33)
EXACT_ON_THIS_BACKEND = PALLAS != "pallas_fused"


def assert_outputs_equal(want, got, rows: int, *, exact: bool, names):
    """Two forms' layer outputs (lists of arrays or None, by `names`) the same: bit for bit
    (exact) or within 2e-5; the core compared on its `rows` real rows; the second finite."""
    for name, a, b in zip(names, want, got):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        if name == "core":
            a, b = a[:rows], b[:rows]
        assert np.isfinite(b).all(), name
        if exact:
            np.testing.assert_array_equal(b, a, err_msg=name)
        else:
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5, err_msg=name)
