"""The compose program's chain kernel on the state cache itself (kernels_pallas/gated_delta/
chain_in_place.py, interpreted here): span_maps.enter moves the chain rows' slots on in place
and writes the same bits as reading the rows' states out, composing them with the chain kernel
and scattering them back; on CUDA the program is one kernel and no scatter of states."""

from __future__ import annotations

import collections
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta.chain_in_place import chain_in_place, conv_piece
from kernels_pallas.gated_delta.chain_triton import chain_apply
from minipic_jax.models import qwen3_5
from serving.hybrid import chain_compose, span_maps
from serving.hybrid.checkpoint_pool import CheckpointPool
from tests.cuda_lowering import abstract_h100, map_pool_0_8b
from tests.test_chain_compose_kernel import _chains, _pool

_PRESETS = jax.lax.DotAlgorithmPreset
_WITH_LAYERS = types.SimpleNamespace(**{k: getattr(qwen3_5, k) for k in (
    "read_states", "write_states", "state_layers", "with_state_layers")})
_WITHOUT_LAYERS = types.SimpleNamespace(read_states=qwen3_5.read_states,
                                        write_states=qwen3_5.write_states)


def _cache(rng, pool, slots=6, conv_dtype=jnp.bfloat16):
    layers, heads, dk = pool.a.shape[1:4]
    conv = pool.tail.shape[2:]
    return qwen3_5.Qwen35Cache(
        k=(), v=(),
        conv=tuple(jnp.asarray(rng.standard_normal((slots,) + conv), conv_dtype)
                   for _ in range(layers)),
        delta=tuple(jnp.asarray(rng.standard_normal((slots, heads, dk, dk)), jnp.float32)
                    for _ in range(layers)))


def _checkpoints(rng, pool, slots=3):
    layers, heads, dk = pool.a.shape[1:4]
    return CheckpointPool(
        conv=jnp.asarray(rng.standard_normal((layers, slots) + pool.tail.shape[2:]),
                         jnp.bfloat16),
        delta=jnp.asarray(rng.standard_normal((layers, slots, heads, dk, dk)), jnp.float32))


def _scenario(rng):
    """Five chain rows over four sequences (state slots 4, 1, 5, 0 of six): a plain chain, a
    chain on a resetting sequence, a restore with no maps, a restore then a chain, and a padding
    row that holds a chain but no sequence (writes nothing). Slots 2 and 3 belong to no row."""
    pool = _pool(rng, slots=7)
    chains = _chains()
    chains[2] = -1
    args = dict(state_slots=jnp.asarray([4, 1, 5, 0], jnp.int32),
                reset=jnp.asarray([False, True, False, False]),
                chain_seq=jnp.asarray([2, 0, 3, 1, -1], jnp.int32), chains=jnp.asarray(chains))
    restore = (_checkpoints(rng, pool), jnp.asarray([-1, -1, 1, 0, -1], jnp.int32))
    return pool, args, restore


def _enter(family, pool, cache, args, restore, precision):
    fn = jax.jit(lambda cache, pool, restore: span_maps.enter(
        family, cache, pool, args["state_slots"], args["reset"], args["chain_seq"],
        args["chains"], precision=precision, restore=restore))
    return fn(cache, pool, restore)


@pytest.mark.parametrize("precision", [None, _PRESETS.BF16_BF16_F32_X6])
def test_in_place_enter_is_read_compose_write_bit_for_bit(fresh_rng, monkeypatch, precision):
    """Both forms through the chain kernel: every conv and delta slot of every layer equal bit
    for bit (the rows' slots moved on, restored, zeroed; the others as they were), the same
    resets cleared; and the composed slots did change."""
    monkeypatch.setattr(chain_compose, "use_kernel",
                        lambda impl="auto", precision=None: impl != "xla")
    monkeypatch.setattr(span_maps, "COMPOSE_IN_PLACE", True)
    pool, args, restore = _scenario(fresh_rng)
    cache = _cache(fresh_rng, pool)
    before = jax.tree.map(np.asarray, cache)
    got_cache, got_reset = _enter(_WITH_LAYERS, pool, cache, args, restore, precision)
    want_cache, want_reset = _enter(_WITHOUT_LAYERS, pool, cache, args, restore, precision)
    np.testing.assert_array_equal(np.asarray(got_reset), np.asarray(want_reset))
    for got, want, old in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache),
                              jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got)[[2, 3]], old[[2, 3]])
        assert not np.array_equal(np.asarray(got)[[4, 1, 5, 0]], old[[4, 1, 5, 0]])
    ck = restore[0]  # the restored row without maps holds its checkpoint (slot 1 of the pool)
    np.testing.assert_array_equal(np.asarray(got_cache.delta[1][0]), np.asarray(ck.delta[1, 1]))


def _random_case(rng, layers, conv, conv_dtype):
    """A random pool (some A blocks exactly zero), cache and chain rows over it: 6 rows of up to
    5 maps (repeats, an empty row, a padding row with a restore slot), resets, restores."""
    heads, dk, dv, n_pool, n_seqs, slots = 2, 8, 16, 6, 5, 8
    a = rng.standard_normal((n_pool, layers, heads, dk, dk)) / np.sqrt(dk)
    a[rng.integers(n_pool), rng.integers(layers)] = 0.0
    a[rng.integers(n_pool), rng.integers(layers), rng.integers(heads)] = 0.0
    pool = span_maps.pool_of(
        a=jnp.asarray(a, jnp.float32),
        b=jnp.asarray(rng.standard_normal((n_pool, layers, heads, dk, dv)), jnp.float32),
        tail=jnp.asarray(rng.standard_normal((n_pool, layers) + conv), jnp.float32),
        count=jnp.asarray(rng.integers(0, 6, n_pool), jnp.int32))
    cache = qwen3_5.Qwen35Cache(k=(), v=(), conv=tuple(
        jnp.asarray(rng.standard_normal((slots,) + conv), conv_dtype) for _ in range(layers)),
        delta=tuple(jnp.asarray(rng.standard_normal((slots, heads, dk, dv)), jnp.float32)
                    for _ in range(layers)))
    chains = np.full((6, 5), -1, np.int32)
    for r, n in enumerate(rng.integers(0, 6, 6)):
        chains[r, :n] = rng.integers(0, n_pool, n)
    chain_seq = np.r_[rng.permutation(n_seqs), -1].astype(np.int32)
    ck = CheckpointPool(
        conv=jnp.asarray(rng.standard_normal((layers, 3) + conv), conv_dtype),
        delta=jnp.asarray(rng.standard_normal((layers, 3, heads, dk, dv)), jnp.float32))
    ck_slot = np.where(rng.random(6) < 0.5, rng.integers(0, 3, 6), -1).astype(np.int32)
    ck_slot[-1] = 1  # the padding row's: nothing is written for it
    args = dict(state_slots=jnp.asarray(rng.permutation(slots)[:n_seqs], jnp.int32),
                reset=jnp.asarray(rng.random(n_seqs) < 0.3), chain_seq=jnp.asarray(chain_seq),
                chains=jnp.asarray(chains))
    return pool, cache, args, (ck, jnp.asarray(ck_slot))


@pytest.mark.parametrize("layers,conv,conv_dtype,precision", [
    (1, (6, 3), jnp.float32, None), (3, (12, 3), jnp.bfloat16, _PRESETS.BF16_BF16_F32_X3),
    (2, (7, 2), jnp.float32, _PRESETS.BF16_BF16_F32_X6), (2, (4, 3), jnp.bfloat16, None)])
def test_random_cases_are_read_compose_write_bit_for_bit(fresh_rng, monkeypatch, layers, conv,
                                                         conv_dtype, precision):
    """Random pools (zero A heads: chains start there), chains, resets, restores and conv
    shapes whose rows are no power of two: both forms equal bit for bit, with the checkpoint
    pool and without."""
    monkeypatch.setattr(chain_compose, "use_kernel",
                        lambda impl="auto", precision=None: impl != "xla")
    monkeypatch.setattr(span_maps, "COMPOSE_IN_PLACE", True)
    pool, cache, args, restore = _random_case(fresh_rng, layers, conv, conv_dtype)
    for r in (restore, None):
        got = _enter(_WITH_LAYERS, pool, cache, args, r, precision)
        want = _enter(_WITHOUT_LAYERS, pool, cache, args, r, precision)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_narrow_value_blocks_compose_as_the_chain_kernel(fresh_rng):
    """block_v below Dv (several value blocks per head: the conv pieces spread over them too):
    the slots hold chain_triton.chain_apply's states at the same block_v, the conv slots the
    windows, the other slots their old bits."""
    pool, cache, args, _ = _random_case(fresh_rng, 2, (12, 3), jnp.float32)
    chains = args["chains"][:5]
    n = span_maps.chain_lengths(chains)
    slots = jnp.asarray([3, 0, 6, 1, 4], jnp.int32)
    start = chain_compose.reset_starts(pool.zero_a, chains, n)
    windows = jnp.asarray(fresh_rng.standard_normal((2, 5, 12, 3)), jnp.float32)
    source = jnp.asarray([0, 0, 0, 1, -1], jnp.int32)  # FROM_SLOT x 3, FROM_ZERO, NO_WRITE
    deltas, convs = chain_in_place(pool.a, pool.b, chains, n, start, source, slots, cache.delta,
                                   cache.conv, windows, block_v=8, interpret=True)
    old = jnp.stack([d[slots] for d in cache.delta]).at[:, 3].set(0.0)
    want = chain_apply(pool.a, pool.b, chains, n, old, start=start, block_v=8, interpret=True)
    for i in range(2):
        got = np.asarray(deltas[i])
        np.testing.assert_array_equal(got[[3, 0, 6, 1]], np.asarray(want[i, :4]))
        np.testing.assert_array_equal(np.asarray(convs[i])[[3, 0, 6, 1]],
                                      np.asarray(windows[i, :4]))
        others = [2, 4, 5, 7]  # slot 4 is the NO_WRITE row's
        np.testing.assert_array_equal(got[others], np.asarray(cache.delta[i])[others])
        np.testing.assert_array_equal(np.asarray(convs[i])[others],
                                      np.asarray(cache.conv[i])[others])


def test_rows_that_write_nothing_leave_the_cache_as_it_was(fresh_rng):
    """A call whose rows all say NO_WRITE (the warm-up's empty programs, padding) returns the
    cache bit for bit, poisoned windows and maps notwithstanding."""
    pool = _pool(fresh_rng, slots=7)
    cache = _cache(fresh_rng, pool)
    chains = jnp.asarray(_chains())
    n = span_maps.chain_lengths(chains)
    rows = chains.shape[0]
    windows = jnp.full((2, rows) + cache.conv[0].shape[1:], jnp.nan, jnp.bfloat16)
    deltas, convs = jax.jit(functools.partial(chain_in_place, interpret=True))(
        pool.a * jnp.nan, pool.b, chains, n, jnp.full((rows, 2, 3), -1, jnp.int32),
        jnp.full(rows, -1, jnp.int32), jnp.arange(rows, dtype=jnp.int32), cache.delta,
        cache.conv, windows)
    for got, want in zip(deltas + convs, cache.delta + cache.conv):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_conv_piece_is_a_power_of_two_dividing_the_row():
    assert conv_piece(6144 * 3) == 2048 and conv_piece(15) == 1 and conv_piece(1 << 20) == 4096
    assert conv_piece(96) == 32


def test_in_place_compose_lowers_to_one_kernel_for_cuda(monkeypatch):
    """Qwen3.5-0.8B's shapes (18 GDN layers x 16 heads, Dk = Dv = 128, bf16 conv states), 16
    rows of up to 8 maps, a checkpoint pool, lowered for an abstract H100: one Triton call, and
    no gather or scatter of whole states (the read-compose-write form stacked the rows' [18, 16,
    16, 128, 128] states and scattered them back, one scatter per layer)."""
    monkeypatch.setattr(chain_compose, "_platform", lambda: "gpu")
    monkeypatch.setattr(span_maps, "COMPOSE_IN_PLACE", True)
    sd = jax.ShapeDtypeStruct
    pool = map_pool_0_8b()
    cache = qwen3_5.Qwen35Cache(k=(), v=(), conv=(sd((17, 6144, 3), jnp.bfloat16),) * 18,
                                delta=(sd((17, 16, 128, 128), jnp.float32),) * 18)
    ck = CheckpointPool(conv=sd((18, 32, 6144, 3), jnp.bfloat16),
                        delta=sd((18, 32, 16, 128, 128), jnp.float32))
    ints = sd((16,), jnp.int32)

    def program(cache, pool, ck, slots, reset, seq, chains, ck_slot):
        return span_maps.enter(qwen3_5, cache, pool, slots, reset, seq, chains,
                               precision=_PRESETS.BF16_BF16_F32_X6, restore=(ck, ck_slot))
    with abstract_h100():
        text = jax.jit(program, donate_argnums=(0,)).trace(
            cache, pool, ck, ints, sd((16,), bool), ints, sd((16, 8), jnp.int32), ints).lower(
            lowering_platforms=("cuda",)).as_text()
    ops = collections.Counter(re.findall(r"(stablehlo\.[a-z_]+|xla\.gpu\.triton)", text))
    assert ops["xla.gpu.triton"] == 1 and ops["stablehlo.while"] == 0, ops
    assert not re.search(r"stablehlo.gather.*-> tensor<[0-9x]*128x128xf32>", text)
    assert not re.search(r"stablehlo.scatter.*tensor<17x16x128x128xf32>", text)
    assert len(re.findall(r"tf.aliasing_output", text)) >= 36
