"""Chunked / Pallas / ragged gated delta rule vs the token-by-token float64 recurrence; exact
checkpoints (bitwise) at chunk boundaries.

The Pallas kernels run in interpret mode; on a GPU, `MINIPIC_COMPILED=1 pytest
tests/test_gated_delta.py` compiles them instead (float32 operands -> IEEE dots)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_inputs import gdn_inputs
from jaxpr_walk import primitive_counts
from kernels_pallas.gated_delta import api, fused_triton, reference

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _inputs(rng, n, t, hk, hv, dk, dv, state=True):
    """gdn_inputs plus an initial state [n, hv, dk, dv] (None with state=False)."""
    x = gdn_inputs(rng, n, t, hk, hv, dk, dv)
    s0 = rng.standard_normal((n, hv, dk, dv)).astype(np.float32) if state else None
    return (*x, s0)


@pytest.mark.parametrize("solve", ["blocked", "trsm"])
def test_chunked_matches_token_recurrence(fresh_rng, solve):
    n, t, hk, hv, dk, dv, chunk = 2, 83, 2, 4, 16, 8, 16  # T not a multiple of the chunk; GVA 2
    q, k, v, g, beta, s0 = _inputs(fresh_rng, n, t, hk, hv, dk, dv)
    ref_out, ref_states = reference.gated_delta_reference(q, k, v, g, beta, s0)
    ck = [0, 32, 64, 80, t]
    # under jit, as a model calls it: one compile, not one per eager op (CI time)
    out, final, cks = jax.jit(lambda *a: api.prefill(*a, checkpoint_at=ck, chunk_size=chunk,
                                                     solve=solve))(q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(final), ref_states[:, -1], atol=2e-5, rtol=0)
    assert cks.shape == (n, len(ck), hv, dk, dv)
    np.testing.assert_array_equal(np.asarray(cks[:, 0]), s0)
    for m, c in enumerate(ck[1:], 1):
        np.testing.assert_allclose(np.asarray(cks[:, m]), ref_states[:, c - 1], atol=2e-5)


def test_pallas_fused_interpret_matches_reference(fresh_rng):
    n, t, hk, hv, dk, dv = 2, 83, 2, 4, 16, 16  # GVA 2, T padded to the chunk inside
    q, k, v, g, beta, s0 = _inputs(fresh_rng, n, t, hk, hv, dk, dv)
    ref_out, ref_states = reference.gated_delta_reference(q, k, v, g, beta, s0)
    ck = np.array([[0, 32, 83], [64, 16, 32]])
    out, final, cks = api.prefill(q, k, v, g, beta, s0, checkpoint_at=ck, chunk_size=16,
                                  implementation="pallas_fused", interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(final), ref_states[:, -1], atol=2e-5, rtol=0)
    for b in range(n):
        for m, c in enumerate(ck[b]):
            want = s0[b] if c == 0 else ref_states[b, c - 1]
            np.testing.assert_allclose(np.asarray(cks[b, m]), want, atol=2e-5)


# the default and other kernel options (intra solve, state layout, checkpoint store, BV)
FUSED_OPTIONS = [{}, dict(intra="subst", layout="kv", ckpt_store="mask", block_v=16),
                 dict(layout="vk", ckpt_store="when", block_v=32),
                 dict(intra="subst", layout="kv", ckpt_store="segments", block_v=32)]


@pytest.mark.parametrize("opts", [FUSED_OPTIONS[0]] + [  # the other options: slow tier (CI time)
    pytest.param(o, marks=pytest.mark.slow) for o in FUSED_OPTIONS[1:]],
    ids=lambda o: "-".join(map(str, o.values())) or "default")
def test_fused_options_match_reference(fresh_rng, opts):
    """Chunk 64 (four 16-row sub-blocks in the blocked solve), GVA 2, Dv split in BV blocks;
    checkpoints (duplicates, 0, the end) equal the recurrence's states."""
    q, k, v, g, beta, s0 = _inputs(fresh_rng, 2, 128, 1, 2, 32, 32)
    ck = jnp.array([[2, 0, 1], [1, 2, 1]])  # chunk indices (2 = final), unsorted, repeated
    run = jax.jit(lambda *a: fused_triton.fused_gated_delta(
        *a, scale=0.25, chunk=64, interpret=INTERPRET, **opts))
    out, final, cks = run(q, k, v, g, beta, s0, ck)
    ref_out, ref_states = reference.gated_delta_reference(q, k, v, g, beta, s0, scale=0.25)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(final), ref_states[:, -1], atol=2e-5, rtol=0)
    for b in range(2):
        for m, c in enumerate(np.asarray(ck[b])):
            want = s0[b] if c == 0 else ref_states[b, 64 * c - 1]
            np.testing.assert_allclose(np.asarray(cks[b, m]), want, atol=2e-5)
    # no checkpoints asked: a kernel without checkpoint code, same out / final bit for bit
    out0, final0, none = jax.jit(lambda *a: fused_triton.fused_gated_delta(
        *a, scale=0.25, chunk=64, interpret=INTERPRET, **opts))(q, k, v, g, beta, s0)
    assert none is None
    np.testing.assert_array_equal(np.asarray(out0), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(final0), np.asarray(final))


@pytest.mark.skipif(not INTERPRET, reason="bitwise equality is asserted on CPU (interpret mode)")
@pytest.mark.parametrize("opts", FUSED_OPTIONS[:2], ids=["default", "subst-kv-mask"])
def test_fused_checkpoint_is_bitwise_state_of_shorter_prefill(fresh_rng, opts):
    q, k, v, g, beta, s0 = _inputs(fresh_rng, 1, 192, 1, 1, 16, 16)
    ck = jnp.array([[1, 2]])
    _, _, cks = fused_triton.fused_gated_delta(q, k, v, g, beta, s0, ck, scale=0.25, chunk=64,
                                               interpret=True, **opts)
    for m, c in enumerate((64, 128)):
        _, final, _ = fused_triton.fused_gated_delta(
            q[:, :c], k[:, :c], v[:, :c], g[:, :c], beta[:, :c], s0, scale=0.25, chunk=64,
            interpret=True, **opts)
        np.testing.assert_array_equal(np.asarray(cks[:, m]), np.asarray(final))


def test_fused_rejects_unknown_option(fresh_rng):
    q, k, v, g, beta, s0 = _inputs(fresh_rng, 1, 16, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="unknown options"):
        fused_triton.fused_gated_delta(q, k, v, g, beta, s0, scale=0.25, chunk=16,
                                       interpret=True, prefetch=True)


def test_decode_step_matches_recurrence(fresh_rng):
    q, k, v, g, beta, s0 = _inputs(fresh_rng, 3, 1, 2, 4, 8, 8)
    ref_out, ref_states = reference.gated_delta_reference(q, k, v, g, beta, s0)
    out, state = api.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    np.testing.assert_allclose(np.asarray(out), ref_out[:, 0], atol=1e-5)
    np.testing.assert_allclose(np.asarray(state), ref_states[:, 0], atol=1e-5)


def test_checkpoint_is_bitwise_state_of_shorter_prefill(fresh_rng):
    """State after chunk-aligned c from a long prefill == final state of a prefill that stopped
    at c, bit for bit (fp32, CPU)."""
    q, k, v, g, beta, s0 = _inputs(fresh_rng, 1, 200, 2, 2, 16, 16)
    ck = [64, 128, 192]
    _, _, cks = jax.jit(lambda *a: api.prefill(*a, checkpoint_at=ck))(q, k, v, g, beta, s0)
    for m, c in enumerate(ck):
        _, final, _ = jax.jit(api.prefill)(q[:, :c], k[:, :c], v[:, :c], g[:, :c], beta[:, :c], s0)
        np.testing.assert_array_equal(np.asarray(cks[:, m]), np.asarray(final))


@pytest.mark.parametrize("impl", ["xla", "pallas_fused"])
def test_ragged_matches_per_sequence_recurrence(fresh_rng, impl):
    hk, hv, dk, dv, chunk = 1, 2, 16, 16, 16
    lens, pos0 = [20, 0, 5, 37, 16], [3, 0, 16, 0, 32]  # shifted starts, an empty sequence
    t = sum(lens) + 5  # bucket padding rows at the end
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, t, hk, hv, dk, dv, state=False)
    s0 = fresh_rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ck = np.array([[16, -1], [-1, -1], [16, 16], [32, 16], [48, 32]], np.int32)
    fn = jax.jit(lambda *a: api.ragged_gated_delta(
        *a, checkpoint_at=jnp.asarray(ck), chunk=chunk, implementation=impl,
        interpret=impl != "xla" and INTERPRET))
    out, fin, cks = fn(q[0], k[0], v[0], g[0], beta[0], cu, np.array(pos0, np.int32), s0)
    out, fin, cks = np.asarray(out), np.asarray(fin), np.asarray(cks)
    assert np.all(out[cu[-1]:] == 0)
    for s in range(len(lens)):
        a, e = cu[s], cu[s + 1]
        if a == e:
            np.testing.assert_array_equal(fin[s], s0[s])
            continue
        ro, rs = reference.gated_delta_reference(q[:, a:e], k[:, a:e], v[:, a:e], g[:, a:e],
                                                 beta[:, a:e], s0[s:s + 1])
        np.testing.assert_allclose(out[a:e], ro[0], atol=2e-5)
        np.testing.assert_allclose(fin[s], rs[0, -1], atol=2e-5)
        for m in range(ck.shape[1]):
            rel = ck[s, m] - pos0[s]
            want = s0[s] if ck[s, m] < 0 or rel == 0 else rs[0, rel - 1]
            np.testing.assert_allclose(cks[s, m], want, atol=2e-5)


@pytest.mark.parametrize("decode", [None, True, False])
def test_ragged_decode_batch(fresh_rng, decode):
    """Every sequence has <= 1 token: the one-step path (decode None: chosen on the device;
    True: named by the caller), or the chunked prefill when the caller names it (False: a step
    whose other rows might prefill); idle sequences keep their state."""
    lens, pos0 = [1, 0, 1], [7, 0, 64]
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, 4, 2, 2, 8, 8, state=False)
    s0 = fresh_rng.standard_normal((3, 2, 8, 8)).astype(np.float32)
    cu = np.cumsum([0] + lens).astype(np.int32)  # [0, 1, 1, 2]
    # under jit, as a model calls it: one compile, not one per eager op (CI time)
    out, fin, _ = jax.jit(functools.partial(api.ragged_gated_delta, decode=decode))(
        q[0], k[0], v[0], g[0], beta[0], cu, np.array(pos0, np.int32), s0)
    np.testing.assert_array_equal(np.asarray(fin[1]), s0[1])
    for s, row in ((0, 0), (2, 1)):
        ro, rs = reference.gated_delta_reference(q[:, row:row + 1], k[:, row:row + 1],
                                                 v[:, row:row + 1], g[:, row:row + 1],
                                                 beta[:, row:row + 1], s0[s:s + 1])
        np.testing.assert_allclose(np.asarray(out[row]), ro[0, 0], atol=1e-5)
        np.testing.assert_allclose(np.asarray(fin[s]), rs[0, -1], atol=1e-5)


def test_ragged_static_kind_has_no_conditional(fresh_rng):
    """A step kind named on the host compiles one branch (no lax.cond: on a GPU each one is a
    host sync per layer) and gives the same numbers as the device's choice."""
    lens, pos0 = [5, 1, 0], [3, 64, 0]
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, 8, 1, 2, 8, 8, state=False)
    s0 = fresh_rng.standard_normal((3, 2, 8, 8)).astype(np.float32)
    args = (q[0], k[0], v[0], g[0], beta[0], np.cumsum([0] + lens).astype(np.int32),
            np.array(pos0, np.int32), s0)
    runs = {}
    for decode in (None, False):
        fn = functools.partial(api.ragged_gated_delta, chunk=8, decode=decode)
        # a cond in the step's own program, not a branch inside a Pallas kernel body
        has_cond = primitive_counts(jax.make_jaxpr(fn)(*args).jaxpr)["cond"] > 0
        assert has_cond == (decode is None)
        runs[decode] = [np.asarray(x) for x in jax.jit(fn)(*args)[:2]]
    for a, b in zip(runs[None], runs[False]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise():
    q = np.zeros((1, 10, 2, 8), np.float32)
    v = np.zeros((1, 10, 3, 8), np.float32)
    g = np.zeros((1, 10, 3), np.float32)
    with pytest.raises(ValueError, match="multiple of key heads"):
        api.prefill(q, q, v, g, g)
    v = np.zeros((1, 10, 4, 8), np.float32)
    g = np.zeros((1, 10, 4), np.float32)
    with pytest.raises(ValueError, match="checkpoint_at offsets"):
        api.prefill(q, q, v, g, g, checkpoint_at=[5], chunk_size=4)
    with pytest.raises(ValueError, match="g must be"):
        api.prefill(q, q, v, g[:, :5], g)
    with pytest.raises(ValueError, match="implementation"):
        api.prefill(q, q, v, g, g, implementation="cuda")


def test_one_policy_picks_the_implementation(monkeypatch):
    """"auto" (or None): the fused Triton kernels on a GPU or when interpreting, XLA on CPU."""
    here = "pallas_fused" if jax.default_backend() == "gpu" else "xla"
    assert api.choose("auto") == api.choose(None) == here  # this run's backend
    assert api.choose("auto", interpret=True) == "pallas_fused"
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    assert api.choose(None) == "pallas_fused" and api.choose("xla") == "xla"
    with pytest.raises(ValueError, match="unknown implementation 'pallas_triton'"):
        api.choose("pallas_triton")  # the scan-only kernel, a measured dead end, is gone



def test_ragged_pallas_at_qwen3_5_fixture_layout(fresh_rng):
    """The model's own call (tests/test_qwen3_5.py's gva2 fixture): 2 key / 4 value heads of 8
    (blocks narrower than the 16 of the tests above), chunk 64, three sequences of 10, 75 and
    155 tokens after 0, 64 + 5 and 3 tokens of state, bucket padding, checkpoints, and decays
    down to the fixture's -60 per token (scripts/gdn_model_bisect.py prints the real ones)."""
    hk, hv, dk, dv = 2, 4, 8, 8
    lens, pos0 = [10, 75, 155], [0, 69, 3]
    t = sum(lens) + 16
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, t, hk, hv, dk, dv, state=False)
    g[..., 1:3] *= 60 / -g[..., 1:3].min(axis=(0, 1))  # two heads decay down to -60 per token
    s0 = fresh_rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    s0[0] = 0  # a fresh sequence
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ck = np.array([[-1, -1], [128, 128], [64, 128]], np.int32)
    fn = jax.jit(lambda *a: api.ragged_gated_delta(
        *a, checkpoint_at=jnp.asarray(ck), implementation="pallas_fused", interpret=INTERPRET))
    out, fin, cks = map(np.asarray, fn(q[0], k[0], v[0], g[0], beta[0], cu,
                                       np.array(pos0, np.int32), s0))
    assert np.all(out[cu[-1]:] == 0)
    for s in range(len(lens)):
        a, e = cu[s], cu[s + 1]
        ro, rs = reference.gated_delta_reference(q[:, a:e], k[:, a:e], v[:, a:e], g[:, a:e],
                                                 beta[:, a:e], s0[s:s + 1])
        np.testing.assert_allclose(out[a:e], ro[0], atol=2e-5, err_msg=f"sequence {s}")
        np.testing.assert_allclose(fin[s], rs[0, -1], atol=2e-5, err_msg=f"sequence {s}")
        for m in range(ck.shape[1]):
            rel = ck[s, m] - pos0[s]
            want = s0[s] if ck[s, m] < 0 else rs[0, rel - 1]
            np.testing.assert_allclose(cks[s, m], want, atol=2e-5, err_msg=f"sequence {s}")


@pytest.mark.parametrize("impl", ["xla", "pallas_fused"])
def test_ragged_checkpoint_at_a_sequence_end_off_the_chunk_grid(fresh_rng, impl):
    """A checkpoint at the end of a sequence's rows that is no multiple of the chunk (a hybrid
    span prompt's chunk ending at its first span start) is the sequence's final state, bit for
    bit: the state a prefill that stopped there computes."""
    hk, hv, dk, dv, chunk = 1, 2, 16, 16, 16
    lens, pos0 = [21, 9, 40], [0, 3, 16]  # ends 21, 12, 56: all off the 16-grid
    t = sum(lens) + 3
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, t, hk, hv, dk, dv, state=False)
    s0 = fresh_rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ends = np.array(pos0) + np.array(lens)
    ck = np.stack([ends, [16, -1, 48]], axis=1).astype(np.int32)
    fn = jax.jit(lambda *a: api.ragged_gated_delta(
        *a, checkpoint_at=jnp.asarray(ck), chunk=chunk, implementation=impl,
        interpret=impl != "xla" and INTERPRET))
    _, fin, cks = fn(q[0], k[0], v[0], g[0], beta[0], cu, np.array(pos0, np.int32), s0)
    fin, cks = np.asarray(fin), np.asarray(cks)
    for s in range(len(lens)):
        np.testing.assert_array_equal(cks[s, 0], fin[s])
    _, rs = reference.gated_delta_reference(q[:, :21], k[:, :21], v[:, :21], g[:, :21],
                                            beta[:, :21], s0[:1])
    np.testing.assert_allclose(cks[0, 1], rs[0, 15], atol=2e-5)  # aligned ones as before


@pytest.mark.parametrize("impl", ["xla", "pallas_fused"])
def test_ragged_checkpoint_at_an_off_grid_start_is_the_state_before(fresh_rng, impl):
    """A checkpoint at a sequence's first position off the chunk grid (a chunk that starts at a
    span prompt's first span start, which the chunk before it ended at) is the state it starts
    from, not the state after its first packed chunk: only a sequence's end rounds up."""
    hk, hv, dk, dv, chunk = 1, 2, 16, 16, 16
    lens, pos0 = [21, 9], [5, 3]
    t = sum(lens) + 2
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, t, hk, hv, dk, dv, state=False)
    s0 = fresh_rng.standard_normal((len(lens), hv, dk, dv)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ck = np.array([[5, 16], [3, -1]], np.int32)  # each sequence's own start, off the grid
    fn = jax.jit(lambda *a: api.ragged_gated_delta(
        *a, checkpoint_at=jnp.asarray(ck), chunk=chunk, implementation=impl,
        interpret=impl != "xla" and INTERPRET))
    _, _, cks = fn(q[0], k[0], v[0], g[0], beta[0], cu, np.array(pos0, np.int32), s0)
    cks = np.asarray(cks)
    np.testing.assert_array_equal(cks[0, 0], s0[0])
    np.testing.assert_array_equal(cks[1, 0], s0[1])
    _, rs = reference.gated_delta_reference(q[:, :21], k[:, :21], v[:, :21], g[:, :21],
                                            beta[:, :21], s0[:1])
    np.testing.assert_allclose(cks[0, 1], rs[0, 16 - 5 - 1], atol=2e-5)  # position 16 as before
