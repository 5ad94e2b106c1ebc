"""A break in the chunked GDN packing (kernels_pallas/gated_delta/ragged.py `packing`): a
sequence's checkpoint off the chunk grid strictly inside its rows (a span prompt's first span
start) is exact without ending the step there. The rows after the break start a chunk of their
own, so one call computes the bits of two prefills, one stopped at the break and one continued
from its state: its outputs, the checkpoint at the break, a grid checkpoint after it and the
final state equal those of the two calls, bit for bit. Before, such a checkpoint was rounded to
a chunk boundary, so the scheduler ended every chunk there (a 200-token first step)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta import ragged
from kernels_pallas.gated_delta.checkpoint_rows import CheckpointRows

C = 16  # the chunk
INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"  # as test_gated_delta.py


def _inputs(rng, t, hv=2, dk=16):
    q, k = (jnp.asarray(rng.standard_normal((t, hv, dk)) * 0.3, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((t, hv, dk)), jnp.float32)
    g = jnp.asarray(-rng.random((t, hv)) * 0.2, jnp.float32)
    beta = jnp.asarray(rng.random((t, hv)), jnp.float32)
    return q, k, v, g, beta


def _call(x, lens, pos0, s0, rows, impl):
    cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
    # jitted: eagerly the packing's ops were an XLA program each
    return jax.jit(lambda *a, rows: ragged.ragged_prefill(
        *a, checkpoint_at=rows, chunk=C, implementation=impl,
        interpret=impl != "xla" and INTERPRET))(*x, cu, jnp.asarray(pos0, jnp.int32), s0,
                                                 rows=rows)


def _rows(seq, pos):
    return CheckpointRows(jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32))


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas_fused"])
def test_a_break_computes_the_bits_of_a_prefill_stopped_there(fresh_rng, impl):
    rng = fresh_rng
    lens, pos0 = np.array([70, 21, 45]), np.array([3, 64, 24])
    brk = np.array([26, 21, 9])  # positions 29 (off the grid), none (seq 1 whole), 33 (off it)
    x = _inputs(rng, int(lens.sum()))
    s0 = jnp.asarray(rng.standard_normal((3, 2, 16, 16)) * 0.1, jnp.float32)
    after = [64, -1, 64]  # a grid checkpoint after each break
    rows = _rows([0, 0, 2, 2, 1], [pos0[0] + brk[0], after[0], pos0[2] + brk[2], after[2], -1])
    out, final, ckpt = _call(x, lens, pos0, s0, rows, impl)

    # the same as two calls: rows before each break, then the rest from their final states
    cu = np.r_[0, np.cumsum(lens)]
    take = lambda parts: tuple(jnp.concatenate([a[i:j] for i, j in parts]) for a in x)  # noqa
    first = take([(cu[s], cu[s] + brk[s]) for s in range(3)])
    second = take([(cu[s] + brk[s], cu[s + 1]) for s in range(3)])
    out1, mid, _ = _call(first, brk, pos0, s0, None, impl)
    rows2 = _rows([0, 2], after[::2])
    out2, final2, ck2 = _call(second, lens - brk, pos0 + brk, mid, rows2, impl)
    out, out1, out2 = (np.asarray(o) for o in (out, out1, out2))
    cu1, cu2 = np.r_[0, np.cumsum(brk)], np.r_[0, np.cumsum(lens - brk)]
    # bit for bit, but XLA compiled for a GPU: its dots tile by shape (cuBLAS / Triton), so two
    # calls of other shapes agree to float32 rounding only (an H100: 2.2e-8, session 35)
    same = np.testing.assert_array_equal if INTERPRET or impl != "xla" else functools.partial(
        np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    for s in range(3):
        same(out[cu[s]:cu[s] + brk[s]], out1[cu1[s]:cu1[s + 1]])
        same(out[cu[s] + brk[s]:cu[s + 1]], out2[cu2[s]:cu2[s + 1]])
    same(np.asarray(final), np.asarray(final2))
    ckpt, mid, ck2 = np.asarray(ckpt), np.asarray(mid), np.asarray(ck2)
    same(ckpt[0], mid[0])  # at the break
    same(ckpt[2], mid[2])
    same(ckpt[1], ck2[0])  # on the grid after it
    same(ckpt[3], ck2[1])
    np.testing.assert_array_equal(ckpt[4], np.asarray(s0[1]))  # an unused row: its state0


def test_break_rows_finds_the_first_off_grid_checkpoint_inside_each_sequence():
    lens, pos0 = jnp.asarray([70, 21, 45, 30]), jnp.asarray([3, 64, 24, 0])
    rows = _rows([0, 0, 1, 2, 2, 3, 0], [48, 29, 85, 40, 33, 30, -1])
    # seq 0: 48 on the grid, 29 off it (row 26); seq 1: 85 = its end; seq 2: 33 (row 9) before
    # 40; seq 3: 30 = its end; the unused row changes nothing
    got = ragged.break_rows(rows, pos0, lens, C)
    np.testing.assert_array_equal(np.asarray(got), [26, 21, 9, 30])


def test_break_rows_keeps_at_most_max_breaks():
    """The packed stream holds max_breaks more chunks: the breaks past them are dropped (their
    checkpoints lose exactness, no row is lost); the host never asks for more."""
    lens, pos0 = jnp.asarray([70, 21, 45, 30]), jnp.asarray([3, 64, 24, 0])
    rows = _rows([0, 1, 2, 3], [29, 69, 33, 5])
    np.testing.assert_array_equal(np.asarray(ragged.break_rows(rows, pos0, lens, C)),
                                  [26, 5, 9, 5])
    np.testing.assert_array_equal(np.asarray(ragged.break_rows(rows, pos0, lens, C, 2)),
                                  [26, 5, 45, 30])
