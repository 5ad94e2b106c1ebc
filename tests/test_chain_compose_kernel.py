"""The GPU form of span-map composition (issue 29, "Composition cost"): the Triton chain kernel
(kernels_pallas/gated_delta/chain_triton.py, interpreted here) and the closed-form conv windows
(serving/hybrid/chain_compose.chain_window) give what the XLA loop gives, at the exactness bar
of tests/test_span_maps.py; on CUDA the compose program is one kernel call and no loop."""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta.chain_triton import chain_apply
from serving.hybrid import chain_compose, span_maps
from tests.cuda_lowering import abstract_h100, map_pool_0_8b

_PRESETS = jax.lax.DotAlgorithmPreset


def _pool(rng, slots=7, layers=2, heads=3, dk=16, conv=(5, 3)):
    """A random pool, A scaled so long chains neither vanish nor blow up; counts 0..5."""
    a = rng.standard_normal((slots, layers, heads, dk, dk)) / np.sqrt(dk)
    return span_maps.pool_of(
        a=jnp.asarray(a, jnp.float32),
        b=jnp.asarray(rng.standard_normal((slots, layers, heads, dk, dk)), jnp.float32),
        tail=jnp.asarray(rng.standard_normal((slots, layers) + conv), jnp.float32),
        count=jnp.asarray(rng.permutation([0, 1, 2, 3, 5, 1, 4][:slots]), jnp.int32))


def _chains():
    """Five rows, unsorted, one empty, one with a repeated slot."""
    chains = np.full((5, 8), -1, np.int32)
    chains[0, :4] = [1, 2, 0, 5]
    chains[1, :2] = [4, 1]
    chains[3, :6] = [0, 6, 1, 0, 5, 6]
    chains[4, :1] = [3]
    return chains


def _states(rng, pool, rows):
    layers, heads, dk = pool.a.shape[1:4]
    conv = jnp.asarray(rng.standard_normal((layers, rows) + pool.tail.shape[2:]), jnp.float32)
    delta = jnp.asarray(rng.standard_normal((layers, rows, heads, dk, dk)), jnp.float32)
    return conv, delta


def _jitted(impl: str):
    """entry_states under jit, as the engine's compose program calls it (eager, each op of the
    loop and of the interpreted kernel compiles on its own: 3x the time, CI)."""
    return jax.jit(functools.partial(span_maps.entry_states, impl=impl))


def test_kernel_composes_as_the_xla_loop(fresh_rng):
    """Unsorted rows of lengths 0..6 on a two-layer pool: the kernel's delta states match the
    loop's (float32 rounding apart), its conv windows are the loop's bit for bit."""
    pool = _pool(fresh_rng)
    chains = jnp.asarray(_chains())
    conv0, delta0 = _states(fresh_rng, pool, chains.shape[0])
    run = lambda impl: _jitted(impl)(pool, chains, conv0, delta0)  # noqa: E731
    (conv_k, delta_k), (conv_x, delta_x) = run("triton"), run("xla")
    np.testing.assert_array_equal(np.asarray(conv_k), np.asarray(conv_x))
    scale = float(jnp.abs(delta_x).max())
    np.testing.assert_allclose(np.asarray(delta_k), np.asarray(delta_x), rtol=0,
                               atol=1e-6 * scale)
    np.testing.assert_array_equal(np.asarray(delta_k[:, 2]), np.asarray(delta0[:, 2]))


def test_chain_window_is_the_shift_loop(fresh_rng):
    """The closed form equals shift_window run map by map, counts 0 to past K1 included."""
    pool = _pool(fresh_rng)
    chains = _chains()
    n = np.asarray(span_maps.chain_lengths(jnp.asarray(chains)))
    window = _states(fresh_rng, pool, chains.shape[0])[0]
    got = jax.jit(chain_compose.chain_window)(pool, jnp.asarray(chains), jnp.asarray(n), window)
    want, shift = np.array(window), jax.jit(chain_compose.shift_window)  # one compile, not per op
    for r, row in enumerate(chains):
        for s in row[:n[r]]:
            want[:, r] = shift(jnp.asarray(want[:, r]), pool.tail[s], pool.count[s])
    np.testing.assert_array_equal(np.asarray(got), want)


def test_kernel_holds_the_exactness_bar():
    """The nine-span chain of tests/test_span_maps.py (1..200 tokens) through the kernel:
    within 1e-6 of the fp32 replay and 1e-5 of the float64 recurrence, as the loop is."""
    from tests.test_gated_delta_affine import _rel
    from tests.test_span_maps import _span_chain
    pool, chains, s0, replay, final64 = _span_chain()
    _, delta = _jitted("triton")(pool, jnp.asarray(chains), jnp.zeros((1, 1, 1, 1)),
                                 jnp.asarray(s0)[None])
    assert _rel(delta[0], replay) < 1e-6 and _rel(delta[0], final64) < 1e-5


def _with_zero_heads():
    """The chains' pool with some (slot, layer, head) A blocks exactly zero: slot 6 in layer 0
    (every head), slot 0 in layer 1 head 2, slot 5 in layer 1 head 0."""
    pool = _pool(np.random.default_rng(7))
    a = np.array(pool.a)
    a[6, 0], a[0, 1, 2], a[5, 1, 0] = 0.0, 0.0, 0.0
    return span_maps.pool_of(jnp.asarray(a), pool.b, pool.tail, pool.count)


def test_reset_starts_are_the_last_zero_map_of_each_head():
    """reset_starts against a loop over every row, layer and head (ended positions ignored)."""
    pool, chains = _with_zero_heads(), _chains()
    chains[2, :3] = [0, 0, 6]  # the empty row gets a chain ending in a zero map
    chains[1, 2:4] = [-1, 6]  # past the row's end: not a start
    n = np.asarray(span_maps.chain_lengths(jnp.asarray(chains)))
    got = np.asarray(chain_compose.reset_starts(pool.zero_a, jnp.asarray(chains), jnp.asarray(n)))
    a = np.asarray(pool.a)
    want = np.full(got.shape, -1)
    for r in range(chains.shape[0]):
        for i in range(n[r]):
            want[r][np.all(a[chains[r, i]] == 0, axis=(-2, -1))] = i
    np.testing.assert_array_equal(got, want)
    assert (want >= 0).sum() >= 10 and (want == -1).sum() >= 10


def test_a_chain_starts_at_its_last_zero_map_bit_for_bit():
    """With the starts, the kernel gives the bits of the whole chain applied (A S + B = B where
    A is zero), and the maps before a head's start are not read: NaN put in them changes
    nothing there (row 3, layer 0: chain [0, 6, 1, 0, 5, 6], slot 6 zero in layer 0)."""
    pool, chains = _with_zero_heads(), jnp.asarray(_chains())
    n = span_maps.chain_lengths(chains)
    delta0 = _states(np.random.default_rng(8), pool, chains.shape[0])[1]
    start = chain_compose.reset_starts(pool.zero_a, chains, n)
    def run(a, start):
        return np.asarray(chain_apply(a, pool.b, chains, n, delta0, start=start, block_v=8,
                                      interpret=True))
    whole, skipped = run(pool.a, None), run(pool.a, start)
    np.testing.assert_array_equal(skipped, whole)
    assert not np.array_equal(whole[0, 3], np.asarray(delta0)[0, 3])
    poisoned = run(pool.a.at[jnp.asarray([0, 1, 5]), 0].set(jnp.nan), start)
    np.testing.assert_array_equal(poisoned[0, 3], whole[0, 3])
    assert np.isnan(run(pool.a.at[jnp.asarray([0, 1, 5]), 0].set(jnp.nan), None)[0, 3]).all()


@pytest.mark.parametrize("preset,bar", [(_PRESETS.BF16_BF16_F32_X3, 1e-4),
                                        (_PRESETS.BF16_BF16_F32_X6, 1e-6)])
def test_bf16_presets_are_computed_not_ignored(fresh_rng, preset, bar):
    """The bf16 emulations split the operands by hand (Triton's dot would cast to one bf16
    pass; XLA's CPU computes the presets as float32): on CPU too they give other bits than
    IEEE float32, within their bar."""
    pool = _pool(fresh_rng)
    chains = jnp.asarray(_chains())
    n = span_maps.chain_lengths(chains)
    delta0 = _states(fresh_rng, pool, chains.shape[0])[1]
    run = functools.partial(chain_apply, pool.a, pool.b, chains, n, delta0, block_v=8,
                            interpret=True)
    exact, got = np.asarray(run()), np.asarray(run(precision=preset))
    assert not np.array_equal(got, exact)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < bar


def test_use_kernel_names_the_choices(monkeypatch):
    """Auto picks the kernel on a GPU only, and only at a tensor-core precision (its IEEE float32
    dots ran at ~0.5 TFLOP/s on an H100, 22x the XLA loop); AUTO_KERNEL off keeps the loop; an
    unknown name is an error naming the choices."""
    tf32 = _PRESETS.TF32_TF32_F32_X3
    assert chain_compose.use_kernel("triton") and not chain_compose.use_kernel("xla", tf32)
    monkeypatch.setattr(chain_compose, "_platform", lambda: "gpu")
    assert chain_compose.use_kernel("auto", tf32)
    assert chain_compose.use_kernel("auto", _PRESETS.BF16_BF16_F32_X6)
    assert not chain_compose.use_kernel("auto") and not chain_compose.use_kernel(
        "auto", jax.lax.Precision.HIGHEST)
    monkeypatch.setattr(chain_compose, "AUTO_KERNEL", False)
    assert not chain_compose.use_kernel("auto", tf32)
    monkeypatch.setattr(chain_compose, "AUTO_KERNEL", True)
    monkeypatch.setattr(chain_compose, "_platform", lambda: "cpu")
    assert not chain_compose.use_kernel("auto", tf32)
    with pytest.raises(ValueError, match="'auto', 'triton', 'xla'"):
        chain_compose.use_kernel("pallas")


def test_compose_lowers_to_one_kernel_for_cuda(monkeypatch):
    """Qwen3.5-0.8B's shapes (18 GDN layers x 16 heads, Dk = Dv = 128), 4 rows of up to 256
    maps, lowered for an abstract H100: one Triton call, no while loop (the XLA form ran one per
    row width, each trip gathering its maps out of the pool), no gather of whole maps."""
    monkeypatch.setattr(chain_compose, "_platform", lambda: "gpu")
    monkeypatch.setattr(chain_compose, "AUTO_KERNEL", True)
    sd = jax.ShapeDtypeStruct
    args = (map_pool_0_8b(), sd((4, 256), jnp.int32), sd((18, 4, 6144, 3), jnp.bfloat16),
            sd((18, 4, 16, 128, 128), jnp.float32))
    fn = jax.jit(functools.partial(span_maps.entry_states,
                                   precision=_PRESETS.TF32_TF32_F32_X3))
    with abstract_h100():
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    ops = collections.Counter(re.findall(r"(stablehlo\.[a-z_]+|xla\.gpu\.triton)", text))
    assert ops["xla.gpu.triton"] == 1 and ops["stablehlo.while"] == 0, ops
    assert "x128x128xf32> = stablehlo.gather" not in text
    assert not re.search(r"stablehlo.gather.*-> tensor<\d+x18x16x128x128xf32>", text)


@pytest.mark.slow  # ~2 min on CPU (an engine, its compose program running the kernel interpreted)
def test_engine_composing_by_the_kernel_matches_the_reference(monkeypatch):
    """tests/test_engine_hybrid_spans.py's cached-span scenario (12 spans skipped, chains of up
    to 4 maps, one shorter than the conv window) with the engine's compose program on the
    kernel: tokens and logprobs within 1e-5 of the float64 hybrid reference."""
    import tests.test_engine_hybrid_spans as spans
    from minipic_jax import LLM
    monkeypatch.setattr(chain_compose, "use_kernel", lambda impl="auto", precision=None: impl != "xla")
    llm = spans._slow_decay(LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
                                max_num_batched_tokens=64, min_token_bucket=64,
                                max_model_len=512, block_size=16, num_kv_blocks=96))
    spans.test_cached_spans_are_skipped_and_match_the_reference(llm, monkeypatch)


def test_engine_chains_start_at_zero_maps_and_match_the_reference(monkeypatch):
    """The same scenario on the preset's own decays (exp(g) ~ 0.03 a token): the spans of 29 and
    40 tokens leave every head's A exactly zero, so the engine's pool flags them (store) and the
    compose program's kernel (in place on the state cache) starts those chains at them
    (reset_starts); tokens and logprobs stay within 1e-5 of the float64 reference."""
    import tests.test_engine_hybrid_spans as spans
    from minipic_jax import LLM
    monkeypatch.setattr(chain_compose, "use_kernel", lambda impl="auto", precision=None: impl != "xla")
    monkeypatch.setattr(span_maps, "COMPOSE_IN_PLACE", True)  # the kernel on the cache in place
    starts, find = [], chain_compose.reset_starts
    monkeypatch.setattr(chain_compose, "reset_starts",
                        lambda *a: starts.append(out := find(*a)) or out)
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4,
              max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512, block_size=16,
              num_kv_blocks=96)
    spans.test_cached_spans_are_skipped_and_match_the_reference(llm, monkeypatch)
    assert starts, "the compose program never ran the kernel"
    assert int(llm.llm_engine.runner.span_pool.zero_a.sum()) > 0
