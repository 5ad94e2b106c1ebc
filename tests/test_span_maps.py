"""serving/hybrid/span_maps.py: the entry state composed from cached span maps on device vs a float64
replay (maps applied in order; conv window = the last Kc - 1 of all earlier inputs), bytes."""

import jax
import jax.numpy as jnp
import numpy as np

from serving.hybrid import span_maps

LG, HV, DK, DV, C, K1 = 2, 2, 4, 3, 5, 3


def _pool(rng, slots):
    pool = span_maps.allocate(slots, LG, HV, DK, DV, C, K1)
    a = rng.standard_normal((LG, slots, HV, DK, DK)).astype(np.float32) * 0.5
    b = rng.standard_normal((LG, slots, HV, DK, DV)).astype(np.float32)
    inputs = [rng.standard_normal((LG, int(n), C)).astype(np.float32)
              for n in rng.integers(1, 6, slots)]  # each span's layer inputs (1..5 tokens)
    tail = np.zeros((LG, slots, C, K1), np.float32)
    for p, x in enumerate(inputs):
        last = x[:, -K1:]  # [LG, <=K1, C], right-aligned
        tail[:, p, :, K1 - last.shape[1]:] = np.swapaxes(last, 1, 2)
    count = np.array([len(x[0]) for x in inputs], np.int32)
    # stored through `store` in a shuffled slot order (with one skipped row)
    order = rng.permutation(slots)
    rows = np.concatenate([order, [-1]])
    pad = lambda x: np.concatenate([x, x[:, :1]], axis=1)  # noqa: E731
    pool = span_maps.store(pool, jnp.asarray(rows, jnp.int32), pad(a[:, order]), pad(b[:, order]),
                           pad(tail[:, order]), np.concatenate([count[order], [99]]))
    return pool, a, b, inputs


def test_entry_states_equal_float64_replay(fresh_rng):
    slots = 6
    pool, a, b, inputs = _pool(fresh_rng, slots)
    chains = [[3, 0, 5, 0], [1, -1, -1, -1], [-1, -1, -1, -1], [5, 4, 2, 1]]  # reuse, any order
    s = len(chains)
    conv0 = fresh_rng.standard_normal((LG, s, C, K1)).astype(np.float32)
    delta0 = fresh_rng.standard_normal((LG, s, HV, DK, DV)).astype(np.float32)
    conv, delta = jax.jit(span_maps.entry_states)(pool, jnp.asarray(chains, jnp.int32),
                                                   conv0, delta0)
    for i, chain in enumerate(chains):
        want = delta0[:, i].astype(np.float64)
        history = [np.swapaxes(conv0[:, i], 1, 2)]  # [LG, K1, C] oldest first
        for p in (p for p in chain if p >= 0):
            want = a[:, p] @ want + b[:, p]
            history.append(inputs[p])
        window = np.swapaxes(np.concatenate(history, axis=1)[:, -K1:], 1, 2)
        np.testing.assert_allclose(np.asarray(delta[:, i]), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(conv[:, i]), window)


def test_map_nbytes_qwen3_5_0_8b():
    """Qwen3.5-0.8B: 18 GDN layers, 16 heads of 128 x 128, conv 6144 x 3, all fp32: A and B are
    1 MiB each per layer, the tail 72 KiB."""
    got = span_maps.map_nbytes(16, 128, 128, 6144, 3, 18)
    assert got["a"] == got["b"] == 1 << 20 and got["tail"] == 6144 * 3 * 4
    assert got["total"] == 18 * ((2 << 20) + 73728) + 4
    half = span_maps.map_nbytes(16, 128, 128, 6144, 3, 18, state_dtype=jnp.bfloat16)
    assert half["a"] == 1 << 19


def test_chain_shapes_pad_to_warm_variants():
    """Chains pad to the engine's one length (a longer one, never expected, goes up by 4x);
    rows are powers of four from 4, at most the step's sequences; warm-up covers every shape a
    step of s sequences can take."""
    from types import SimpleNamespace

    from serving.hybrid import span_step
    batch = lambda *lens: [SimpleNamespace(map_chain=[0] * n) for n in lens]  # noqa: E731
    assert span_step.chain_length(8) == 16 and span_step.chain_length(128) == 128
    assert span_step.chain_shape(batch(3, 0, 1), 8) == (4, 16)
    assert span_step.chain_shape(batch(16, 2, 2, 2, 2), 8) == (8, 16)
    assert span_step.chain_shape(batch(*[1] * 5), 64, 128) == (16, 128)
    assert span_step.chain_shape(batch(*[1] * 17), 64, 128) == (64, 128)
    assert span_step.chain_shape(batch(17), 2) == (2, 64)
    assert span_step.warm_chains(4, 32) == [(4, 32)]
    assert span_step.warm_chains(64, 32) == [(4, 32), (16, 32), (64, 32)]
    for s in (2, 4, 8, 32, 64):  # every step's shape is warm
        warm = set(span_step.warm_chains(s, 32))
        assert all(span_step.chain_shape(batch(*[32] * n), s, 32) in warm for n in range(1, s + 1))
