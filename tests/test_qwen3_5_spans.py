"""Qwen3.5 with SSEP spans in a ragged step (cold path: qwen3_5_spans.py) vs the float64 hybrid
span reference, two sequences with the same spans at other offsets and in other orders in ONE call,
then a decode step on the carried (flow) state."""

import dataclasses
import functools

import hybrid_span_reference as hsr
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES

from minipic_jax.loading import load_model
from minipic_jax.models import qwen3_5, qwen3_5_spans, testing

SSEP, PDEP = 250, 251


@functools.lru_cache(maxsize=None)
def _model():
    """The gva2 fixture's config cut to GDN, attention, GDN (the span-local hidden states cross
    an attention layer into a second recurrent layer), fresh std-0.02 weights (well conditioned
    in float32)."""
    cfg = load_model(str(FIXTURES / "qwen3_5_gva2")).cfg
    cfg = dataclasses.replace(cfg, num_layers=3, layer_types=(
        "linear_attention", "full_attention", "linear_attention"))
    return qwen3_5.init_params(cfg, jax.random.key(0)), cfg


_fwd = jax.jit(qwen3_5.forward_with_checkpoints, static_argnames=("cfg", "kv_mode", "gdn_impl"))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _rows(prompts, seg_lists, span_lists):
    """Per real row: segment id unique across sequences, is-span, window start (logical)."""
    seg_ids, spans, win = [], [], []
    base = 0
    for seg, span in zip(seg_lists, span_lists):
        starts = {s: int(np.flatnonzero(seg == s)[0]) for s in set(seg.tolist())}
        seg_ids += (seg + base).tolist()
        spans += [span[s] for s in seg]
        win += [starts[s] if span[s] else 0 for s in seg]
        base += len(span)
    return np.asarray(seg_ids), np.asarray(spans), np.asarray(win, np.int32)


@pytest.mark.slow  # CI time (tests/test_engine_hybrid_spans.py covers it): --run-slow
def test_spans_in_a_ragged_step_match_the_reference(fresh_rng):
    params, cfg = _model()
    text = lambda n: fresh_rng.integers(0, 240, n).tolist()  # noqa: E731
    sys_a, sys_b, q = text(9), text(20), [PDEP] + text(6)
    span1, span2 = [SSEP] + text(13), [SSEP] + text(5)
    # the third prompt ends in a span: its generated token extends the span (local state); a
    # short one, so the flow before it still shows in the conv window and the decayed state
    prompts = [sys_a + span1 + span2 + q, sys_b + span2 + span1 + q, sys_b + q + [SSEP] + text(1)]
    parsed = [hsr.segments(p, block_size=1, pad=-1, ssep=SSEP, pdep=PDEP) for p in prompts]
    seg_ids, spans, win = _rows(prompts, [s for _, s, _ in parsed], [sp for _, _, sp in parsed])
    pager = testing.SimplePager(3, 64, 4, seed=1)
    cache = qwen3_5.init_cache(cfg, pager.num_pages, 4, 3)
    carry = [sp[-1] for _, _, sp in parsed]
    md, _, total = pager.step([len(p) for p in prompts])
    window = np.zeros(md.num_tokens, np.int32)
    window[:total] = win
    md = dataclasses.replace(md, q_window_start=jnp.asarray(window))
    pieces = qwen3_5_spans.pieces_from_segments(seg_ids, md.num_tokens, 12, spans, carry)
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:total] = np.concatenate(prompts)
    logits, cache, _ = _fwd(params, jnp.asarray(tokens), md, cache, cfg=cfg, span_pieces=pieces)
    logits = np.asarray(logits)[:total]
    bounds = np.cumsum([0] + [len(p) for p in prompts])
    worst = 0.0
    nxt = []
    for i, (kept, seg, span) in enumerate(parsed):
        want = hsr.reference_logprobs(params, cfg, kept, seg, span)
        got = _log_softmax(logits[bounds[i]:bounds[i + 1]])
        worst = max(worst, float(np.abs(got - want).max()))
        nxt.append(int(np.argmax(got[-1])))
    # decode one token per sequence from the carried state (the flow after a PDEP question, the
    # span's local state after a final span); same bucket and pieces argument as the prefill,
    # so the same compiled step
    md, _, _ = pager.step([1, 1, 1], min_tokens=total)
    step_tokens = np.zeros(md.num_tokens, np.int32)
    step_tokens[:3] = nxt
    window = np.zeros(md.num_tokens, np.int32)
    window[:3] = [win[bounds[i + 1] - 1] for i in range(3)]  # the last segment's window
    md = dataclasses.replace(md, q_window_start=jnp.asarray(window))
    pieces = qwen3_5_spans.pieces_from_segments([0, 1, 2], md.num_tokens, 12, [False] * 3,
                                                [False] * 3)  # the carried state continues
    logits2, _, _ = _fwd(params, jnp.asarray(step_tokens), md, cache, cfg=cfg,
                         span_pieces=pieces)
    for i, (kept, seg, span) in enumerate(parsed):
        want = hsr.reference_logprobs(params, cfg, kept + [nxt[i]], np.r_[seg, seg[-1]], span)
        worst = max(worst, float(np.abs(_log_softmax(logits2[i]) - want[-1]).max()))
    print(f"max abs logprob error vs the float64 reference: {worst:.2e}")
    assert worst < 1e-5
    # sanity: the spans' own rows agree across the two prompts, the questions do not
    a, b = (_log_softmax(logits[bounds[i]:bounds[i + 1]]) for i in (0, 1))
    np.testing.assert_allclose(a[9:23], b[20 + 6:20 + 20], atol=1e-5)
    assert np.abs(a[-7:] - b[-7:]).max() > 1e-3
