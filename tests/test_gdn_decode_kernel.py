"""The in-place GDN decode kernel (kernels_pallas/gated_delta/decode_triton.py) against the XLA
decode step it replaces: the model's gather of each row's state out of the cache (zeros where the
row resets), `chunked.recurrent_step`, the one-step branch's keep-the-state for rows with no
token, and the scatter back. Interpreted here; MINIPIC_COMPILED=1 compiles it for the GPU."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta.chunked import recurrent_step
from kernels_pallas.gated_delta.decode_triton import (decode_conv_layer_in_place,
                                                      decode_in_place, decode_layer_in_place)

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"


def _inputs(seed, rows, slots, hk, hv, dk, dv, dtype):
    rng = np.random.default_rng(seed)
    qk = rng.standard_normal((2, rows, hk, dk)).astype(np.float32)
    qk /= np.linalg.norm(qk, axis=-1, keepdims=True)  # l2-normed, as the model's
    q, k = (jnp.asarray(x, dtype) for x in qk)
    v = jnp.asarray(rng.standard_normal((rows, hv, dv)), dtype)
    g = jnp.asarray(-rng.uniform(0.01, 2.0, (rows, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (rows, hv)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((slots, hv, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state, slots, keep, has, scale):
    s0 = jnp.where(keep[:, None, None, None], state[slots], 0.0)
    out, new = recurrent_step(q, k, v, g, beta, s0, scale=scale)
    new = jnp.where(has[:, None, None, None], new, s0)
    return jnp.where(has[:, None, None], out, 0.0), state.at[slots].set(new)


@pytest.mark.parametrize("hk,hv,dk,dv,dtype", [(2, 4, 16, 32, jnp.float32),
                                               (2, 2, 32, 64, jnp.bfloat16)])
def test_decode_in_place_matches_the_xla_step(hk, hv, dk, dv, dtype):
    """Rows that keep their state, reset, have no token, and padding rows sharing a scratch slot
    (last): outputs and every slot of the cache agree with the gather / step / scatter."""
    rows, slots_n = 6, 9
    q, k, v, g, beta, state = _inputs(0, rows, slots_n, hk, hv, dk, dv, dtype)
    slots = jnp.array([3, 0, 7, 5, 8, 8], jnp.int32)  # 8: the scratch slot of two padding rows
    keep = jnp.array([True, False, True, True, True, True])
    has = jnp.array([True, True, False, True, False, False])
    scale = dk ** -0.5
    want_out, want_state = _reference(q, k, v, g, beta, state, slots, keep, has, scale)
    out, got = jax.jit(functools.partial(decode_in_place, interpret=INTERPRET),
                       donate_argnums=(5,))(q, k, v, g, beta, state, slots, keep, has)
    real = np.array([0, 1, 2, 3])  # rows with their own slot (the scratch slot is garbage)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(want_out)[real],
                               rtol=2e-6, atol=2e-6)
    kept = np.array([s for s in range(slots_n) if s != 8])
    np.testing.assert_allclose(np.asarray(got)[kept], np.asarray(want_state)[kept],
                               rtol=2e-6, atol=2e-6)


def test_decode_layer_in_place_matches_the_xla_layer():
    """The kernel with the layer's glue (l2 norms, gates, gated RMS norm) against the XLA
    layer's own functions around the step: qwen3_5_gdn.l2norm, sigmoid / softplus gates,
    gated_rms_norm, in bf16 as the model runs (its rounding points replayed in the kernel)."""
    from minipic_jax.models.qwen3_5_gdn import gated_rms_norm, l2norm
    rows, slots_n, hk, hv, dk, dv, dtype = 5, 8, 2, 4, 16, 32, jnp.bfloat16
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.standard_normal((rows, hk, dk)), dtype) for _ in range(2))
    v, z = (jnp.asarray(rng.standard_normal((rows, hv, dv)), dtype) for _ in range(2))
    a, b = (jnp.asarray(rng.standard_normal((rows, hv)), dtype) for _ in range(2))
    a_log, dt_bias = (jnp.asarray(rng.standard_normal(hv) * 0.5, dtype) for _ in range(2))
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(dv), dtype)
    state = jnp.asarray(rng.standard_normal((slots_n, hv, dk, dv)), jnp.float32)
    slots = jnp.array([6, 1, 4, 7, 7], jnp.int32)  # 7: the scratch slot of a padding row
    keep = jnp.array([True, False, True, True, True])
    has = jnp.array([True, True, False, True, False])
    eps = 1e-6
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    core, want_state = _reference(l2norm(q), l2norm(k), v, g, beta, state, slots, keep, has,
                                  dk ** -0.5)
    want = gated_rms_norm(core.astype(dtype), z, norm, eps)
    got, got_state = decode_layer_in_place(q, k, v, a, b, a_log, dt_bias, z, norm, state, slots,
                                           keep, has, eps=eps, interpret=INTERPRET)
    real, kept = np.array([0, 1, 2, 3]), np.arange(7)
    assert got.dtype == dtype
    # bf16 outputs: one unit in the last place where a float32 sum's order differs
    np.testing.assert_allclose(np.asarray(got, np.float32)[real],
                               np.asarray(want, np.float32)[real], rtol=8e-3, atol=8e-3)
    np.testing.assert_allclose(np.asarray(got_state)[kept], np.asarray(want_state)[kept],
                               rtol=2e-6, atol=2e-6)


def _layer_inputs(seed, rows, slots_n, hk, hv, dk, dv, dtype):
    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    x = jnp.asarray(rng.standard_normal((rows, c)), dtype)
    conv_w = jnp.asarray(rng.standard_normal((c, 4)) * 0.5, dtype)
    conv_cache = jnp.asarray(rng.standard_normal((slots_n, c, 3)), dtype)
    z = jnp.asarray(rng.standard_normal((rows, hv, dv)), dtype)
    a, b = (jnp.asarray(rng.standard_normal((rows, hv)), dtype) for _ in range(2))
    a_log, dt_bias = (jnp.asarray(rng.standard_normal(hv) * 0.5, dtype) for _ in range(2))
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(dv), dtype)
    state = jnp.asarray(rng.standard_normal((slots_n, hv, dk, dv)), jnp.float32)
    return x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm, state


def test_decode_conv_layer_in_place_matches_the_xla_layer():
    """The kernel with the layer's causal conv too: each row's conv window from its conv state
    (zeros on a reset), silu(conv) split into q / k / v, then the glue and the step, against
    qwen3_5_gdn's conv_silu / l2norm / gated_rms_norm; the conv state moves on by the row's
    input (stays where the row has no token) in place, like the recurrent state."""
    from minipic_jax.models.qwen3_5_gdn import conv_silu, gated_rms_norm, l2norm
    rows, slots_n, h, dk, dv, dtype = 5, 8, 2, 16, 32, jnp.bfloat16
    x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm, state = _layer_inputs(
        4, rows, slots_n, h, h, dk, dv, dtype)
    slots = jnp.array([6, 1, 4, 7, 7], jnp.int32)  # 7: the scratch slot of a padding row
    keep = jnp.array([True, False, True, True, True])
    has = jnp.array([True, True, False, True, False])
    past = jnp.where(keep[:, None, None], conv_cache[slots], 0).astype(dtype)  # [N, C, 3]
    window = jnp.concatenate([past, x[:, :, None]], axis=-1)
    qkv = conv_silu(window, conv_w).astype(dtype)
    q = qkv[:, :h * dk].reshape(rows, h, dk)
    k = qkv[:, h * dk:2 * h * dk].reshape(rows, h, dk)
    v = qkv[:, 2 * h * dk:].reshape(rows, h, dv)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    core, want_state = _reference(l2norm(q), l2norm(k), v, g, jax.nn.sigmoid(b), state, slots,
                                  keep, has, dk ** -0.5)
    want = gated_rms_norm(core.astype(dtype), z, norm, 1e-6)
    want_conv = conv_cache.at[slots].set(jnp.where(has[:, None, None], window[:, :, 1:], past))
    got, got_conv, got_state = decode_conv_layer_in_place(
        x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm, state, slots, keep, has, eps=1e-6,
        interpret=INTERPRET)
    real, kept = np.array([0, 1, 2, 3]), np.arange(7)
    np.testing.assert_array_equal(np.asarray(got_conv)[kept], np.asarray(want_conv)[kept])
    np.testing.assert_allclose(np.asarray(got, np.float32)[real],
                               np.asarray(want, np.float32)[real], rtol=8e-3, atol=8e-3)
    # interpreted, the conv sums in the reference's order: the states agree to 2.4e-7 (CPU);
    # compiled, XLA's conv may sum in another order, and a bf16 q / k / v one ulp apart moves
    # the state by up to that much (~4e-3 relative)
    tol = 2e-6 if INTERPRET else 1e-2
    np.testing.assert_allclose(np.asarray(got_state)[kept], np.asarray(want_state)[kept],
                               rtol=tol, atol=tol)


def test_decode_in_place_names_what_does_not_fit():
    q, k, v, g, beta, state = _inputs(1, 2, 3, 2, 4, 16, 32, jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        decode_in_place(q, k, v, g, beta, state.astype(jnp.bfloat16), jnp.zeros(2, jnp.int32),
                        jnp.ones(2, bool), jnp.ones(2, bool), interpret=True)
    x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm, state2 = _layer_inputs(
        2, 2, 3, 2, 4, 16, 32, jnp.float32)  # Hk 2 < Hv 4: shared q / k channels
    with pytest.raises(ValueError, match="as many key heads"):
        decode_conv_layer_in_place(x, conv_w, conv_cache, a, b, a_log, dt_bias, z, norm, state2,
                                   jnp.zeros(2, jnp.int32), jnp.ones(2, bool), jnp.ones(2, bool),
                                   eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        decode_in_place(q, k, v, g, beta, state, jnp.zeros(2, jnp.int32), jnp.ones(2, bool),
                        jnp.ones(2, bool), block_v=24, interpret=True)


# form -> (qwen3_5 flags GDN_DECODE_GLUE, GDN_DECODE_CONV; the api function the layers call;
# the model: the conv form needs as many key heads as value heads, tiny_qwen3_5 has 2 / 4)
FORMS = {"state": (False, False, "decode_in_place", "tiny_qwen3_5"),
         "glue": (True, False, "decode_layer_in_place", "tiny_qwen3_5"),
         "conv": (True, True, "decode_conv_layer_in_place", "qwen3_5_tied")}


# `glue` is the engine's form; the other two are kept for A/B and run in the slow tier (CI time)
@pytest.mark.parametrize("form", [f if f == "glue" else pytest.param(f, marks=pytest.mark.slow)
                                  for f in FORMS])
def test_engine_decode_steps_step_states_in_place(form, monkeypatch):
    """qwen3_5.GDN_DECODE_IN_PLACE on: an engine's decode-only steps (their own variant:
    decode_attn_impl) reach the form's kernel in every GDN layer and give the tokens and
    logprobs of the gather / step / scatter path (the GDN kernels interpreted in both)."""
    from pathlib import Path

    from kernels_pallas.gated_delta import decode_rows as api  # where the kernels are called
    from minipic_jax import LLM, SamplingParams
    from minipic_jax.models import qwen3_5
    glue, conv, name, model = FORMS[form]
    if model != "tiny_qwen3_5":
        model = str(Path(__file__).parent / "fixtures" / model)
    calls = []
    kernel = getattr(api, name)
    monkeypatch.setattr(api, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(qwen3_5, "GDN_DECODE_GLUE", glue)
    monkeypatch.setattr(qwen3_5, "GDN_DECODE_CONV", conv)
    # the spy counts the decode steps' calls: prefill steps' one-row sequences call the state
    # form's kernel too (ONE_ROWS_IN_PLACE, tests/test_one_rows_in_place.py)
    monkeypatch.setattr(qwen3_5, "ONE_ROWS_IN_PLACE", False)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(5, 200, 20 + 7 * i).tolist()} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(qwen3_5, "GDN_DECODE_IN_PLACE", on)
        # step_cache off: the step is traced here (the spy counts trace-time calls), not loaded
        llm = LLM(model, max_num_seqs=4, decode_attn_impl="triton_decode", warmup=False,
                  step_cache="off", num_kv_blocks=64)  # a pool of its own size on a GPU too
        llm.llm_engine.runner.gdn_impl = "pallas_fused_interpret"  # Config takes compiled names
        outs[on] = llm.generate(prompts, sp, use_tqdm=False)
        layers = llm.llm_engine.runner.mcfg.layer_types.count("linear_attention")
        assert len(calls) == (layers if on else 0)  # one decode variant traced
    for want, got in zip(outs[False], outs[True]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lw, lg in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            np.testing.assert_allclose([lg[t].logprob for t in lw], [lw[t].logprob for t in lw],
                                       atol=1e-5)


def test_on_rows_is_the_scatter_of_each_sequences_output_to_its_row(fresh_rng):
    """decode_rows.on_rows (a gather the consumer takes in) gives what a scatter of each
    sequence's output into its row of zeros gave: sequences with no row in the middle, padding
    rows past the last sequence, a garbage (NaN) output of a sequence with no row never read."""
    from kernels_pallas.gated_delta.decode_rows import on_rows
    lens = np.array([1, 0, 1, 1, 0, 1])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    out_s = fresh_rng.standard_normal((6, 2, 3)).astype(np.float32)
    out_s[lens == 0] = np.nan
    t = 7  # two padding rows
    want = np.zeros((t, 2, 3), np.float32)
    want[np.asarray(cu[:-1])[lens > 0]] = out_s[lens > 0]
    got = np.asarray(on_rows(jnp.asarray(out_s), cu, t, jnp.float32))
    np.testing.assert_array_equal(got, want)
