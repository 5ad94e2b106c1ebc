"""serving/hybrid/span_maps.py: the entry state composed from cached span maps on device vs a float64
replay (maps applied in order; conv window = the last Kc - 1 of all earlier inputs), bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta.affine import COMPOSE_PRECISIONS, compose_precision
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
    pytest.param(16, (1, 9, 0, 16, 5, 9, 3, 1), 47,  # 44 maps; widths 8, 6, 4, 3, 1 run (was
                 marks=pytest.mark.slow),  # 16 x 16); slow tier: CI time
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
    rows are powers of two from 4, at most the step's sequences; warm-up covers every shape a
    step of s sequences can take."""
    from types import SimpleNamespace

    from serving.hybrid import span_step
    batch = lambda *lens: [SimpleNamespace(map_chain=[0] * n) for n in lens]  # noqa: E731
    assert span_step.chain_length(8) == 16 and span_step.chain_length(128) == 128
    assert span_step.chain_shape(batch(3, 0, 1), 8) == (4, 16)
    assert span_step.chain_shape(batch(16, 2, 2, 2, 2), 8) == (8, 16)
    assert span_step.chain_shape(batch(*[1] * 5), 64, 128) == (8, 128)
    assert span_step.chain_shape(batch(*[1] * 9), 64, 128) == (16, 128)
    assert span_step.chain_shape(batch(*[1] * 17), 64, 128) == (32, 128)
    assert span_step.chain_shape(batch(17), 2) == (2, 64)
    assert span_step.warm_chains(4, 32) == [(4, 32)]
    assert span_step.warm_chains(64, 32) == [(4, 32), (8, 32), (16, 32), (32, 32), (64, 32)]
    for s in (2, 4, 8, 32, 64):  # every step's shape is warm
        warm = set(span_step.warm_chains(s, 32))
        assert all(span_step.chain_shape(batch(*[32] * n), s, 32) in warm for n in range(1, s + 1))


# The exactness bar each composition precision must hold (Config.span_maps.compose_precision):
# the default's (1e-6 of the fp32 replay, as tests/test_gated_delta_affine.py) for IEEE float32
# and the emulations that could replace it; bf16_x3 keeps ~16 mantissa bits (asked 1e-4).
PRECISION_BARS = {"highest": 1e-6, "bf16_x6": 1e-6, "tf32_x3": 1e-6, "bf16_x3": 1e-4}


@functools.lru_cache(maxsize=1)
def _span_chain():
    """Nine spans of 1..200 tokens (tests/test_gated_delta_affine.py), their maps in a one-layer
    pool: (pool, chains [1, 16], s0, fp32 replay, float64 final state); computed once."""
    from tests.test_gated_delta_affine import span_maps_and_replay
    lengths = (1, 5, 64, 1, 63, 65, 200, 3, 128)
    a, b, s0, replay, final64 = span_maps_and_replay(np.random.default_rng(29), lengths)
    n, hv, dk, dv = len(lengths), s0.shape[1], s0.shape[2], s0.shape[3]
    pool = span_maps.pool_of(a=a, b=b, tail=jnp.zeros((n, 1, 1, 1)),
                             count=jnp.ones(n, jnp.int32))  # a [n, 1, ...]: one GDN layer
    chains = np.full((1, 16), -1, np.int32)
    chains[0, :n] = np.arange(n)
    assert pool.a.shape == (n, 1, hv, dk, dk) and pool.b.shape == (n, 1, hv, dk, dv)
    return pool, chains, s0, replay, final64


@pytest.mark.parametrize("name", list(PRECISION_BARS))
def test_composition_precision_holds_its_bar(name):
    """The engine's composition (entry_states, as the compose program runs it) at each named
    precision against the fp32 replay and the float64 recurrence. On CPU every name computes
    IEEE float32 (affine.compose_precision); with MINIPIC_COMPILED=1 on a GPU the presets are
    tensor-core emulations: benchmarks/runs/compose_next_device.sh reads the printed errors."""
    from tests.test_gated_delta_affine import _rel
    pool, chains, s0, replay, final64 = _span_chain()
    run = jax.jit(functools.partial(span_maps.entry_states, precision=compose_precision(name)))
    _, delta = run(pool, jnp.asarray(chains), jnp.zeros((1, 1, 1, 1)), jnp.asarray(s0)[None])
    rel32, rel64 = _rel(delta[0], replay), _rel(delta[0], final64)
    print(f"compose precision {name}: rel vs fp32 replay {rel32:.2e}, vs float64 {rel64:.2e}")
    assert rel32 < PRECISION_BARS[name] and rel64 < max(1e-5, PRECISION_BARS[name])


def test_compose_precision_names():
    """Presets on a GPU only (XLA's CPU computes the bf16 ones as float32, rejects TF32_X3);
    an unknown name is an error naming the choices, from the engine Config too; every name has
    its bar above."""
    from serving.config import Config
    assert set(PRECISION_BARS) == set(COMPOSE_PRECISIONS)
    assert compose_precision("highest", "gpu") == jax.lax.Precision.HIGHEST
    assert compose_precision("tf32_x3", "gpu") == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert compose_precision("bf16_x6", "cpu") == jax.lax.Precision.HIGHEST
    with pytest.raises(ValueError, match="bf16_x6"):
        compose_precision("bf16", "gpu")
    with pytest.raises(ValueError, match="span_map_compose_precision"):
        Config.from_flat(span_map_compose_precision="tf32")
    assert Config.from_flat(span_map_compose_precision="tf32_x3").span_maps.compose_precision \
        == "tf32_x3"


def test_engine_compose_program_takes_the_configured_precision(monkeypatch):
    """span_map_compose_precision reaches the engine's compose program, traced as on a GPU (not
    compiled) in both forms: on the XLA loop each of its dots asks the configured preset; on the
    chain kernel (a GPU's "auto" at a tensor-core preset; read-compose-write or in place on the
    state cache, COMPOSE_IN_PLACE) the kernel is called with it."""
    from jaxpr_walk import outer_eqns

    from kernels_pallas.gated_delta import affine
    from minipic_jax import LLM
    from serving.hybrid import chain_compose
    monkeypatch.setattr(affine, "_backend", lambda: "gpu")
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=64,
              min_token_bucket=64, max_model_len=512, block_size=16, num_kv_blocks=96,
              warmup=False, span_map_compose_precision="tf32_x3")
    runner = llm.llm_engine.runner
    ints, _, kw = runner.composer.warmup_steps(runner.ck_pool is not None)[0]
    args = runner._args(ints, None, False, kw)

    def trace(platform):
        monkeypatch.setattr(chain_compose, "_platform", lambda: platform)
        return jax.make_jaxpr(functools.partial(runner._step_impl, **kw))(*args).jaxpr

    preset = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    dots = [e.params["precision"] for e in outer_eqns(trace("cpu"))
            if e.primitive.name == "dot_general"]
    assert dots and all(p == preset for p in dots), dots
    for in_place, kernel in ((False, "chain_apply"), (True, "chain_in_place")):
        seen = []
        real = getattr(chain_compose, kernel)
        monkeypatch.setattr(span_maps, "COMPOSE_IN_PLACE", in_place)
        monkeypatch.setattr(chain_compose, kernel,
                            lambda *a, real=real, **k: seen.append(k["precision"]) or real(*a, **k))
        jaxpr = trace("gpu")
        assert seen == [preset], (kernel, seen)
        assert not [e for e in outer_eqns(jaxpr) if e.primitive.name == "dot_general"]
