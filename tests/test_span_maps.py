"""serving/hybrid/span_maps.py: the entry state composed from cached span maps on device vs a float64
replay (maps applied in order; conv window = the last Kc - 1 of all earlier inputs), bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.hybrid import chain_compose, span_maps

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


def _replay(a, b, inputs, chain, conv0, delta0):
    """float64 replay of one row: (conv window [LG, C, K1], delta [LG, HV, DK, DV])."""
    want = delta0.astype(np.float64)
    history = [np.swapaxes(conv0, 1, 2)]  # [LG, K1, C] oldest first
    for p in (p for p in chain if p >= 0):
        want = a[:, p] @ want + b[:, p]
        history.append(inputs[p])
    return np.swapaxes(np.concatenate(history, axis=1)[:, -K1:], 1, 2), want


def _check_rows(entry, chains, conv0, delta0, a, b, inputs):
    conv, delta = entry
    for i, chain in enumerate(chains):
        window, want = _replay(a, b, inputs, chain, conv0[:, i], delta0[:, i])
        np.testing.assert_allclose(np.asarray(delta[:, i]), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(conv[:, i]), window)


def test_entry_states_equal_float64_replay(fresh_rng):
    slots = 6
    pool, a, b, inputs = _pool(fresh_rng, slots)
    chains = [[3, 0, 5, 0], [1, -1, -1, -1], [-1, -1, -1, -1], [5, 4, 2, 1]]  # reuse, any order
    s = len(chains)
    conv0 = fresh_rng.standard_normal((LG, s, C, K1)).astype(np.float32)
    delta0 = fresh_rng.standard_normal((LG, s, HV, DK, DV)).astype(np.float32)
    entry = jax.jit(span_maps.entry_states)(pool, jnp.asarray(chains, jnp.int32), conv0, delta0)
    _check_rows(entry, chains, conv0, delta0, a, b, inputs)


@pytest.mark.parametrize("rows,lengths,applied", [
    (4, (0, 12, 10, 8), 30),  # run 3 on the H200: 30 maps on 3 of 4 rows; was 4 x 12 = 48
    (16, (1, 9, 0, 16, 5, 9, 3, 1), 47),  # 44 maps; widths 8, 6, 4, 3, 1 run (was 16 x 16)
])
def test_composition_applies_only_the_maps_its_chains_hold(fresh_rng, rows, lengths, applied):
    """Issue 29, composition cost: the compose program applies each chain's maps to its row and
    skips ended chains. Counted from the FLOPs of the dots the program runs for these chains
    (tests/jaxpr_flops.py: loops at their real trip counts): exactly the maps held up to 4 rows,
    at most 3/2 of them at 16 (static widths), and what chain_compose.applications plans (the
    bench's figure). The states still equal the float64 replay."""
    from jaxpr_flops import dot_flops
    slots = 6
    pool, a, b, inputs = _pool(fresh_rng, slots)
    chains = np.full((rows, 16), -1, np.int32)
    for r, n in enumerate(lengths):
        chains[r, :n] = fresh_rng.integers(0, slots, n)
    conv0 = fresh_rng.standard_normal((LG, rows, C, K1)).astype(np.float32)
    delta0 = fresh_rng.standard_normal((LG, rows, HV, DK, DV)).astype(np.float32)
    flops = dot_flops(span_maps.entry_states, pool, jnp.asarray(chains), conv0, delta0)
    assert flops % (2 * LG * HV * DK * DK * DV) == 0
    assert flops // (2 * LG * HV * DK * DK * DV) == applied <= 1.5 * sum(lengths)
    assert chain_compose.applications(lengths, rows) == applied
    entry = jax.jit(span_maps.entry_states)(pool, jnp.asarray(chains), conv0, delta0)
    _check_rows(entry, chains, conv0, delta0, a, b, inputs)


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
