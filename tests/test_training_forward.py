"""The training forward (dense [B, L] batches, Block-Attention masks) against three oracles:
the engine's own outputs on the same segmented prompt (train-serve consistency), the independent
float64 dense reference (tests/dense_reference.py), and HF transformers' logits (fixtures)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, hf_reference, make_tiny_llm
from dense_reference import reference_logprobs, segment_windows

from minipic_jax import Prompt, SamplingParams, Span
from minipic_jax.loading import load_model
from minipic_jax.models import llama
from minipic_jax.training.batch import make_batch
from minipic_jax.training.data import Markers, Record, layout_example
from minipic_jax.training.loop import engine_markers

TOL = 1e-4


_training_forward = jax.jit(llama.training_forward,
                            static_argnames=("cfg", "compute_dtype", "remat", "attn_impl"))


def _forward(params, cfg, examples, seq_len, **kw):
    b = make_batch(examples, seq_len)
    logits = _training_forward(params, b.tokens, b.positions, b.windows, b.valid, cfg=cfg, **kw)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def _segments(rng, n_spans):
    toks = lambda lo, hi: [int(t) for t in rng.integers(0, 256, int(rng.integers(lo, hi)))]
    return (Prompt(toks(3, 20)),) + tuple(Span(toks(3, 40)) for _ in range(n_spans)) + (
        Prompt(toks(2, 10)),)


def test_training_forward_equals_engine_on_segmented_prompts(fresh_rng):
    """Engine (paged kernels, block manager, warm span hits) vs training forward: the top-5
    logprobs of every generated step agree to 1e-4 in fp32."""
    llm = make_tiny_llm(num_kv_blocks=64, min_token_bucket=64)  # one compiled step (CI time)
    # the training's own markers: beyond the vocabulary, fed as the ids they borrow
    markers = engine_markers(llm.llm_engine.loaded, llm.config.block_size)
    assert markers.pad_token_id == llm.llm_engine.markers["pad_token_id"] == 512
    segs = [_segments(fresh_rng, n) for n in (2, 3)]
    segs.append(segs[0][:1] + segs[1][1:3] + segs[0][1:])  # spans reused at other offsets
    prompts = [list(s) for s in segs]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, logprobs=5))
    params, cfg = llm.llm_engine.loaded.params, llm.llm_engine.loaded.cfg
    params = llama.unfuse_params(params)
    examples = [layout_example(Record(s, tuple(o.outputs[0].token_ids)), markers, None,
                               eos_token_id=None) for s, o in zip(segs, outs)]
    got = _forward(params, cfg, examples, max(len(e.tokens) for e in examples), remat=False)
    for r, (ex, out) in enumerate(zip(examples, outs)):
        rows = np.flatnonzero(ex.loss_mask)  # the rows that predicted each generated token
        assert len(rows) == len(out.outputs[0].token_ids)
        for j, step in enumerate(out.outputs[0].logprobs):
            for tok, lp in step.items():
                assert abs(got[r, rows[j], tok] - lp.logprob) < TOL, (r, j, tok)


def test_training_forward_equals_dense_reference(fresh_rng):
    """Random segment structures, all rows, against the float64 Block-Attention reference."""
    cfg = load_model("tiny_llama").cfg
    params = llama.init_params(cfg, jax.random.key(int(fresh_rng.integers(1 << 30))))
    markers = Markers(block_size=8, pad_token_id=511, ssep_token_id=510, pdep_token_id=509)
    examples = [layout_example(Record(_segments(fresh_rng, n), (5, 6, 7)), markers, None,
                               eos_token_id=257) for n in (0, 1, 3)]
    seq_len = max(len(e.tokens) for e in examples) + 3  # batch padding too
    got = _forward(params, cfg, examples, seq_len)
    for r, ex in enumerate(examples):
        kept, win = segment_windows(list(ex.tokens), 8, 511, 510, 509)  # answer: last segment
        want = reference_logprobs(params, cfg, kept, win)
        assert np.abs(got[r, :len(ex.tokens)][ex.valid] - want).max() < TOL


@pytest.mark.parametrize("name", ["llama_gqa2_llama3rope", "llama_gqa4_tied_hd16"])
def test_training_forward_matches_hf_logits(name):
    """All fixture prompts in one right-padded batch (full causal attention, no blocks)."""
    m, ref = load_model(FIXTURES / name), hf_reference(FIXTURES / name)
    seqs = [p + g[:-1] for p, g in zip(ref["prompts"], ref["greedy"])]
    seq_len = max(len(q) for q in seqs)
    tokens = np.zeros((len(seqs), seq_len), np.int32)
    valid = np.zeros((len(seqs), seq_len), bool)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)], valid[i, :len(q)] = q, True
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), tokens.shape)
    logits = np.asarray(_training_forward(m.params, tokens, positions, np.zeros_like(tokens),
                                          valid, cfg=m.cfg))
    for i, want in enumerate(ref["logits"]):
        assert np.abs(logits[i, :len(want)] - want).max() <= TOL, f"prompt {i}"
