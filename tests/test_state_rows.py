"""The ragged scan reads its sequences' initial states where they live (state_rows.StateRows:
the layer's state cache by slot, zeros, the identity, a layered span-map pool) instead of a table
built before the kernel: the same outputs, finals and checkpoints bit for bit as with that table
materialized, in both state layouts, and `take` is the table's gather. Interpret mode on CPU;
`MINIPIC_COMPILED=1` compiles the kernels on a GPU (there within float32 summation order)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from kernels_pallas.gated_delta import api, fused_triton
from kernels_pallas.gated_delta.state_rows import EYE, ZERO, StateRows, from_cache

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
HK, HV, DK, DV, CHUNK = 1, 2, 16, 16, 16


def _table(rng):
    """Rows: 3 cache slots (one reset to zero), zero, I, a pool entry of layer 1, I again."""
    cache = jnp.asarray(rng.standard_normal((9, HV, DK, DV)), jnp.float32)
    pool = jnp.asarray(0.3 * rng.standard_normal((5, 3, HV, DK, DV)), jnp.float32)
    flow = from_cache(cache, jnp.asarray([7, 2, 4], jnp.int32), jnp.asarray([True, False, True]))
    kind = jnp.concatenate([flow.kind, jnp.asarray([ZERO, EYE, 1, EYE], jnp.int32)])
    index = jnp.concatenate([flow.index, jnp.asarray([0, 0, 3, 0], jnp.int32)])
    rows = StateRows((cache, pool), kind, index, (None, 1))
    eye = np.broadcast_to(np.eye(DK, dtype=np.float32), (HV, DK, DV))
    c, zero = np.asarray(cache), np.zeros((HV, DK, DV), np.float32)
    want = np.stack([c[7], zero, c[4], zero, eye, np.asarray(pool)[3, 1], eye])
    return rows, want


def test_take_is_the_table_gather(fresh_rng):
    rows, want = _table(fresh_rng)
    np.testing.assert_array_equal(np.asarray(rows.materialize()), want)
    pick = jnp.asarray([6, 0, 5, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(rows.take(pick)), want[np.asarray(pick)])
    assert rows.shape == want.shape


@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_the_scan_reads_state_rows_in_place_bit_for_bit(fresh_rng, monkeypatch, layout):
    rows, table = _table(fresh_rng)
    lens, pos0 = [20, 0, 5, 37, 16, 1, 9], [3, 0, 16, 0, 32, 7, 0]  # one sequence per row
    t = sum(lens) + 7
    q, k, v, g, beta = (x[0] for x in gdn_inputs(fresh_rng, 1, t, HK, HV, DK, DV))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ends = np.array(pos0) + np.array(lens)
    ck = np.stack([ends, [16, -1, 16, 32, 48, -1, -1]], axis=1).astype(np.int32)
    monkeypatch.setitem(fused_triton.DEFAULTS, "layout", layout)

    def run(state0):
        fn = jax.jit(lambda *a: api.ragged_gated_delta(
            *a, checkpoint_at=jnp.asarray(ck), chunk=CHUNK, implementation="pallas_fused",
            interpret=INTERPRET, decode=False))
        return [np.asarray(x) for x in fn(q, k, v, g, beta, cu, np.array(pos0, np.int32),
                                          state0)]
    in_place, built = run(rows), run(jnp.asarray(table))
    for name, a, b in zip(("out", "final", "checkpoints"), built, in_place):
        if INTERPRET:
            np.testing.assert_array_equal(b, a, err_msg=name)
        else:  # compiled, "vk": the state tile arrives transposed in registers, and Triton's
            # float32 dots then sum in another order (H100: 11 of 3,040 outputs 3.7e-9 apart)
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(in_place[1][1], table[1])  # an empty sequence keeps its row
    assert np.isfinite(in_place[0][: cu[-1]]).all()


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("impl,seq_parallel", [  # the serial scan (A/B form): slow tier, CI time
    ("pallas_fused", True), pytest.param("pallas_fused", False, marks=pytest.mark.slow),
    ("xla", True)])
def test_finals_written_into_the_cache_are_the_scatter_bit_for_bit(fresh_rng, monkeypatch,
                                                                   layout, impl, seq_parallel):
    """StateRows.write_final (the plain prefill step's flow, qwen3_5.GDN_FINALS_IN_PLACE): the
    scan kernel writes each sequence's final state into its cache slot in place, and the
    prefill returns the cache: bit for bit the cache the model scattered the [S] finals into
    (with its outputs and checkpoints), for sequences with and without tokens, kept and reset
    (a reset one without tokens ends at zero), other slots untouched. The serial scan and the
    XLA path scatter after the scan (`finals_in_kernel` False): the same values."""
    from kernels_pallas.gated_delta import ragged, ragged_triton
    monkeypatch.setitem(fused_triton.DEFAULTS, "layout", layout)
    monkeypatch.setattr(ragged_triton, "SEQ_PARALLEL", seq_parallel)
    cache = jnp.asarray(fresh_rng.standard_normal((10, HV, DK, DV)), jnp.float32)
    slots = jnp.asarray([7, 2, 4, 0, 9, 5], jnp.int32)
    keep = jnp.asarray([True, False, True, False, True, True])
    lens, pos0 = [20, 0, 37, 5, 0, 16], [3, 0, 0, 16, 7, 32]  # slots 2 (reset), 9: no tokens
    t = sum(lens) + 5
    q, k, v, g, beta = (x[0] for x in gdn_inputs(fresh_rng, 1, t, HK, HV, DK, DV))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ends = np.array(pos0) + np.array(lens)
    ck = np.stack([ends, [16, -1, 32, -1, -1, -1]], axis=1).astype(np.int32)
    interpret = INTERPRET and impl != "xla"

    def run(write_final):
        def step(cache, *a):
            rows = from_cache(cache, slots, keep, write_final=write_final)
            out, final, ckpt = api.ragged_gated_delta(
                *a, rows, checkpoint_at=jnp.asarray(ck), chunk=CHUNK, implementation=impl,
                interpret=interpret, decode=False)
            return out, (final if write_final else cache.at[slots].set(final)), ckpt
        return [np.asarray(x) for x in jax.jit(step)(cache, q, k, v, g, beta, cu,
                                                     np.array(pos0, np.int32))]
    assert ragged.finals_in_kernel(from_cache(cache, slots, keep, True), impl) == (
        impl != "xla" and seq_parallel)
    scattered, written = run(False), run(True)
    for name, a, b in zip(("out", "cache", "checkpoints"), scattered, written):
        np.testing.assert_array_equal(b, a, err_msg=name)
    c = np.asarray(cache)
    np.testing.assert_array_equal(written[1][2], 0)  # reset, no tokens: zeros
    np.testing.assert_array_equal(written[1][9], c[9])  # kept, no tokens: as it was
    for untouched in (1, 3, 6, 8):
        np.testing.assert_array_equal(written[1][untouched], c[untouched])
    assert not np.array_equal(written[1][7], c[7])  # a sequence with tokens moved on


def test_write_final_needs_one_cache_source_and_the_prefill():
    cache = jnp.zeros((4, HV, DK, DV), jnp.float32)
    pool = jnp.zeros((4, 3, HV, DK, DV), jnp.float32)
    two = ((cache, cache), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="and one source unless final_rows"):
        StateRows(*two, write_final=True)
    with pytest.raises(ValueError, match="first source without a layer"):
        StateRows((pool,), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), (1,),
                  write_final=True, final_rows=jnp.zeros(2, jnp.int32))
    StateRows(*two, write_final=True, final_rows=jnp.asarray([1, -1], jnp.int32))  # a joint table
    rows = from_cache(cache, jnp.asarray([1, 2], jnp.int32), jnp.asarray([True, True]), True)
    x = jnp.zeros((2, HK, DK), jnp.float32)
    with pytest.raises(ValueError, match="needs decode=False"):
        api.ragged_gated_delta(x, x, jnp.zeros((2, HV, DV)), jnp.zeros((2, HV)),
                               jnp.zeros((2, HV)), jnp.asarray([0, 1, 2], jnp.int32),
                               jnp.zeros(2, jnp.int32), rows, decode=True)
