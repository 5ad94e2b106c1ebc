"""A decode step's GDN conv read straight from the conv state (qwen3_5_gdn.DECODE_CONV_DIRECT:
`decode_taps`, `decode_history`): each sequence has at most one new token, so a row's Kc - 1
earlier inputs are its sequence's state columns and the state moves on by that one row. The
same bits as the general form (shifted_taps / read_history through the step's history index)
on every row that belongs to a sequence and for every sequence's next state, over random
ragged decode layouts: sequences with no token, padding rows, bf16 inputs over a float32 or a
bf16 state. And the whole decode layer per sequence (DECODE_SEQ_ROWS: an engine's decode-only
step has sequence i's token on row i), the same bits through the model's forward."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minipic_jax.models import qwen3_5_decode_conv as decode_conv
from minipic_jax.models import qwen3_5_gdn as gdn

# the new tests' GDN kernels: compiled with MINIPIC_COMPILED=1 on a GPU, else interpreted
COMPILED_OR_INTERPRETED = ("pallas_fused" if os.environ.get("MINIPIC_COMPILED") == "1"
                           else "pallas_fused_interpret")

K1 = 3


def _decode_layout(rng, n_seqs: int, n_rows: int):
    """cu_q_lens of a decode step: each sequence 0 or 1 token, rows past the last one padding."""
    lens = rng.integers(0, 2, n_seqs)
    lens[rng.integers(n_seqs)] = 1
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] <= n_rows
    return jnp.asarray(cu), jnp.asarray(rng.integers(0, 500, n_seqs), jnp.int32)


@jax.jit
def _both_forms(x, conv0, w, cu, pos0):
    """The general form's (shifted_taps / read_history) and the direct form's conv outputs and
    next states, in one program per layout shape (op-by-op dispatch compiled each op for each
    shape: CI time)."""
    seq_of_row = gdn.rows_of_seqs(cu, x.shape[0])
    index = gdn.conv_index(cu, pos0, seq_of_row, K1)
    want = gdn.conv_rows_silu(gdn.shifted_taps(x, conv0, index["rows"]) + [x], w)
    got = gdn.conv_rows_silu(decode_conv.decode_taps(x, conv0, seq_of_row), w)
    want_state = gdn.read_history(x, conv0, index["end"]).astype(conv0.dtype)
    return want, got, want_state, decode_conv.decode_history(x, conv0, cu)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_decode_conv_is_the_general_conv_bit_for_bit(fresh_rng, state_dtype):
    channels = 24
    for case in range(12):
        n_seqs, n_rows = int(fresh_rng.integers(1, 9)), 8
        cu, pos0 = _decode_layout(fresh_rng, n_seqs, n_rows)
        x = jnp.asarray(fresh_rng.standard_normal((n_rows, channels)), jnp.bfloat16)
        conv0 = jnp.asarray(fresh_rng.standard_normal((n_seqs, channels, K1)), state_dtype)
        w = jnp.asarray(fresh_rng.standard_normal((channels, K1 + 1)), jnp.float32)
        want, got, want_state, got_state = _both_forms(x, conv0, w, cu, pos0)
        real = np.arange(n_rows) < int(cu[-1])
        np.testing.assert_array_equal(np.asarray(got)[real], np.asarray(want)[real], f"{case}")
        assert got_state.dtype == want_state.dtype
        np.testing.assert_array_equal(np.asarray(got_state, np.float32),
                                      np.asarray(want_state, np.float32), f"{case}")
        moved = np.asarray(cu[1:] > cu[:-1])
        if moved.any():  # the state did move where a sequence had its token
            assert not np.array_equal(np.asarray(got_state, np.float32)[moved],
                                      np.asarray(conv0, np.float32)[moved])


def test_decode_steps_take_the_direct_conv(monkeypatch):
    """The in-place decode with glue (an engine's decode-only steps) calls decode_taps once per
    GDN layer when DECODE_SEQ_ROWS or DECODE_CONV_DIRECT is on, never when both are off."""
    from benchmarks.span_step_ops import model_cfg
    from minipic_jax.models import qwen3_5
    from minipic_jax.models.testing import SimplePager
    from serving.model_contract import RecurrentMetadata
    cfg = model_cfg(2)
    calls, taps = [], decode_conv.decode_taps
    monkeypatch.setattr(gdn, "decode_taps", lambda *a: calls.append(1) or taps(*a))
    pager = SimplePager(4, 32, 16, seed=0)
    pager.step([5, 7, 3, 9])
    md, _, _ = pager.step([1, 1, 1, 1])
    rec = RecurrentMetadata(state_slots=jnp.arange(4, dtype=jnp.int32), reset=jnp.zeros(4, bool),
                            decode=True)
    params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 64, 16, 4, jnp.bfloat16))
    for seq_rows, direct, want in ((True, False, 2), (False, True, 2), (False, False, 0)):
        calls.clear()
        monkeypatch.setattr(gdn, "DECODE_SEQ_ROWS", seq_rows)
        monkeypatch.setattr(gdn, "DECODE_CONV_DIRECT", direct)
        jax.make_jaxpr(lambda p, c: qwen3_5.forward(
            p, jnp.zeros(md.num_tokens, jnp.int32), md, c, cfg, recurrent=rec,
            gdn_impl="pallas_fused_interpret"))(params, cache)
        assert len(calls) == want


def _decode_step(counts, min_tokens, reset, dtype, *, pager_seed, before, rng_seed, key,
                 fused=False):
    """An engine-like decode-only step on tiny_qwen3_5 (sequence i's token on row i): each
    sequence first holds before[0] + before[1] i tokens; random params (fused with `fused`),
    caches and tokens. Returns (cfg, metadata, logits rows, RecurrentMetadata, params, cache,
    tokens)."""
    from configs.presets import PRESETS
    from minipic_jax.models import qwen3_5
    from minipic_jax.models.testing import SimplePager
    from serving.model_contract import RecurrentMetadata
    cfg = PRESETS["tiny_qwen3_5"]
    n = len(counts)
    pager = SimplePager(n, 48, 8, seed=pager_seed)
    pager.step([before[0] + before[1] * i for i in range(n)])
    md, logits_idx, _ = pager.step(counts, min_tokens)
    rng = np.random.default_rng(rng_seed)
    rec = RecurrentMetadata(state_slots=jnp.asarray(rng.permutation(n + 2)[:n], jnp.int32),
                            reset=jnp.asarray(reset, bool), decode=True)
    params = qwen3_5.init_params(cfg, jax.random.key(key), dtype)
    params = qwen3_5.fuse_params(params) if fused else params
    cache = qwen3_5.init_cache(cfg, 160, 8, n + 2, dtype)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), cache)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, md.num_tokens), jnp.int32)
    return cfg, md, logits_idx, rec, params, cache, tokens


@pytest.mark.parametrize("counts,min_tokens,dtype,reset", [
    ([1, 1, 1, 0], 0, jnp.bfloat16, [0, 1, 0, 0]), ([1, 1, 0, 0], 16, jnp.float32, [1, 0, 0, 0]),
    ([1, 1, 1] + [0] * 9, 0, jnp.float32, [0, 0, 1] + [0] * 9)] + [  # the rest: slow tier (CI time)
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ([1, 1, 1, 1], 0, jnp.float32, [0, 0, 0, 0]), ([1], 0, jnp.bfloat16, [0])]])
def test_decode_layer_per_sequence_is_the_row_form_bit_for_bit(monkeypatch, counts, min_tokens,
                                                               dtype, reset):
    """An engine's decode-only step (sequence i's token on row i, the ones with none last) on
    tiny_qwen3_5 with its GDN decode kernel interpreted: the layer run per sequence
    (DECODE_SEQ_ROWS), the direct conv on rows (DECODE_CONV_DIRECT) and the general form give
    the same logits, conv and state caches bit for bit: as many rows as sequences, more, one
    sequence, float32 and bfloat16, resets; with fewer rows than sequences (idle ones past them)
    the layer keeps the rows form (padded rows cost the last bits on an H100, s29d)."""
    from minipic_jax.models import qwen3_5
    cfg, md, logits_idx, rec, params, cache, tokens = _decode_step(
        counts, min_tokens, reset, dtype, pager_seed=0, before=(3, 2), rng_seed=3, key=1)
    outs = {}
    for form in ((False, False), (False, True), (True, True)):
        monkeypatch.setattr(gdn, "DECODE_SEQ_ROWS", form[0])
        monkeypatch.setattr(gdn, "DECODE_CONV_DIRECT", form[1])
        outs[form] = jax.jit(lambda p, c: qwen3_5.forward(
            p, tokens, md, c, cfg, recurrent=rec, logits_indices=logits_idx,
            gdn_impl="pallas_fused_interpret"))(params, cache)
    want = jax.tree.leaves(outs[(False, False)])
    for form in ((False, True), (True, True)):
        for got, ref in zip(jax.tree.leaves(outs[form]), want):
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(ref, np.float32), f"{form}")


def test_seq_rows_and_back_are_static_slices(fresh_rng):
    """decode_rows.seq_rows / on_seq_rows against the gathers they replace, T < S, T = S, T > S:
    sequence i's row i per sequence, and back on the rows zeros past the sequences' rows
    whatever the idle sequences' outputs hold (NaN here)."""
    from kernels_pallas.gated_delta.decode_rows import on_rows, on_seq_rows, seq_rows
    for n_rows, n_seqs, used in ((4, 6, 3), (5, 5, 5), (8, 3, 2)):
        cu = jnp.asarray(np.r_[np.arange(used + 1), np.full(n_seqs - used, used)], jnp.int32)
        x = jnp.asarray(fresh_rng.standard_normal((n_rows, 3)), jnp.float32)
        if n_rows < n_seqs:  # the layer keeps the rows form there
            with pytest.raises(ValueError, match="no row per sequence"):
                seq_rows(x, n_seqs)
        else:
            np.testing.assert_array_equal(np.asarray(seq_rows(x, n_seqs))[:used],
                                          np.asarray(x)[:used])
            assert seq_rows(x, n_seqs).shape == (n_seqs, 3)
        out_s = jnp.asarray(fresh_rng.standard_normal((n_seqs, 2)), jnp.float32)
        out_s = out_s.at[used:].set(jnp.nan)
        got = np.asarray(on_seq_rows(out_s, cu, n_rows, jnp.float32))
        np.testing.assert_array_equal(got, np.asarray(on_rows(out_s, cu, n_rows, jnp.float32)))
        assert got.shape == (n_rows, 2) and not np.isnan(got).any()


def test_decode_only_steps_lay_sequence_i_on_row_i():
    """The contract DECODE_SEQ_ROWS reads (RecurrentMetadata.decode): in an engine's decode-only
    steps sequence i's token is row i and the sequences with none come last, cu_q_lens [0, 1,
    ..., d, d, ...], also as sequences finish at different steps and the batch shrinks."""
    from minipic_jax import LLM, SamplingParams
    llm = LLM("tiny_qwen3_5", dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=64,
              min_token_bucket=64, max_model_len=256, block_size=16, warmup=False)  # one bucket
    runner = llm.llm_engine.runner
    runner.separate_decode = True  # the GPU's layout: decode-only steps are a variant of their own
    views, seen = {}, []
    buffers, dispatch = runner._buffers, runner._dispatch

    def keep_views(*a, **k):
        out = buffers(*a, **k)
        views["v"] = out[2]
        return out

    def check(ints, floats, use_prev, kw):
        if kw.get("decode_only"):
            cu = np.array(views["v"]["cu_q_lens"])
            d = int(cu[-1])
            np.testing.assert_array_equal(cu[:d + 1], np.arange(d + 1))
            assert (cu[d + 1:] == d).all() and d >= 1
            seen.append(d)
        return dispatch(ints, floats, use_prev, kw)
    runner._buffers, runner._dispatch = keep_views, check
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(5, 200, 9 + 6 * i).tolist()} for i in range(4)]
    sps = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True)
           for i in range(4)]
    llm.generate(prompts, sps, use_tqdm=False)
    assert len(set(seen)) >= 3, seen  # the batch shrank as sequences finished


def test_a_decode_layer_per_sequence_gathers_only_its_conv_state():
    """benchmarks/decode_step_ops.py's jaxpr counts per GDN layer of a decode step: per sequence
    one gather (the conv state by slot) and one scatter (it, written back), where the general
    form gathered 13 times (each kernel input at its sequence's row, the conv's history)."""
    from benchmarks import decode_step_ops
    per_seq = decode_step_ops.per_layer("per_seq", decode_step_ops.jaxpr_ops)
    general = decode_step_ops.per_layer("general", decode_step_ops.jaxpr_ops)
    assert per_seq["gather"] == 1 and per_seq["scatter"] == 1 and per_seq["transpose"] == 0
    assert general["gather"] > 5 * per_seq["gather"]


@pytest.mark.parametrize("counts,min_tokens,dtype,reset", [  # DECODE_GATES_IN_PROJ is off:
    ([1, 1, 1, 0], 16, jnp.bfloat16, [1, 0, 0, 0])] + [  # its other cases in the slow tier
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ([1, 1, 1, 1], 0, jnp.float32, [0, 1, 0, 0]), ([1], 0, jnp.bfloat16, [0])]])
def test_decode_gates_read_in_the_projection_bit_for_bit(monkeypatch, counts, min_tokens, dtype,
                                                         reset):
    """qwen3_5_gdn.DECODE_GATES_IN_PROJ: with fused weights the per-sequence decode layer's
    kernel reads a, b and z as columns of the layer's projection (no sliced operands, each a
    copy kernel on a GPU): the same logits and caches bit for bit, rows past the sequences
    (min_tokens) and idle sequences included; and the kernel's call takes the projection."""
    from kernels_pallas.gated_delta import decode_rows
    from minipic_jax.models import qwen3_5
    cfg, md, logits_idx, rec, params, cache, tokens = _decode_step(
        counts, min_tokens, reset, dtype, pager_seed=1, before=(4, 3), rng_seed=5, key=2,
        fused=True)
    widths, kernel = [], decode_rows.decode_layer_in_place

    def spy(*a, proj=None, **k):
        widths.append(None if proj is None else proj[0].shape)
        return kernel(*a, proj=proj, **k)
    monkeypatch.setattr(decode_rows, "decode_layer_in_place", spy)  # where the layer calls it
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(gdn, "DECODE_GATES_IN_PROJ", on)
        widths.clear()
        outs[on] = jax.jit(lambda p, c: qwen3_5.forward(
            p, tokens, md, c, cfg, recurrent=rec, logits_indices=logits_idx,
            gdn_impl=COMPILED_OR_INTERPRETED))(params, cache)
        hk, hv, dk, dv, c, _ = gdn.gdn_dims(cfg)
        want = (md.num_tokens, c + hv * dv + 2 * hv) if on else None
        assert widths and all(w == want for w in widths), widths
    for got, ref in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_decode_gates_in_the_projection_lower_for_cuda():
    """The kernel reading a, b, z in the projection lowers for an H100 (Triton) at Qwen3.5-0.8B's
    widths (8 rows, 16 heads x 128, projection 6,144 + 2,048 + 32 wide, bf16): one Triton call,
    the projection its operand whole (no [8, 16] / [8, 2048] slices made for it)."""
    import re

    from kernels_pallas.gated_delta.decode_triton import decode_layer_in_place
    from tests.cuda_lowering import abstract_h100
    sd = jax.ShapeDtypeStruct
    rows, hv, dk, slots = 8, 16, 128, 65
    qk = sd((rows, hv, dk), jnp.bfloat16)
    proj = sd((rows, 6144 + hv * dk + 2 * hv), jnp.bfloat16)
    vec = sd((hv,), jnp.bfloat16)
    ints = sd((rows,), jnp.int32)

    def call(q, k, v, x, a_log, dt_bias, norm, state, slots_, keep, has):
        return decode_layer_in_place(q, k, v, None, None, a_log, dt_bias, None, norm, state,
                                     slots_, keep, has, eps=1e-6, proj=(x, 6144))
    with abstract_h100():
        text = jax.jit(call).trace(qk, qk, qk, proj, vec, vec, sd((dk,), jnp.bfloat16),
                                   sd((slots, hv, dk, dk), jnp.float32), ints, ints,
                                   ints).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert not re.search(r"stablehlo.slice.*tensor<8x8224xbf16>", text)
