"""The float64 hybrid span reference (hybrid_span_reference.py): HF parity on plain prompts, span
semantics (a span's outputs depend on its tokens only, at any offset and in any order), and the
link to the kernels: composing the spans' cached maps (affine.py, maps from the chunked layer) gives
the flow state the reference replays token by token at every PDEP segment entry."""

import functools

import hybrid_span_reference as hsr
import jax
import jax.numpy as jnp
import numpy as np
from conftest import FIXTURES

from kernels_pallas.gated_delta import affine, api
from minipic_jax.loading import load_model

BLOCK, SSEP, PDEP, PAD = 16, 250, 251, 257  # marker ids for these tests (tiny vocab of 260)


@functools.lru_cache(maxsize=None)
def _model():
    return load_model(str(FIXTURES / "qwen3_5_gva2"))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_plain_prompts_match_hf():
    lm = _model()
    ref = np.load(FIXTURES / "qwen3_5_gva2" / "reference.npz")
    for i in (0, 1):  # 10 and 75 tokens (+ greedy continuation)
        full = np.concatenate([ref[f"prompt_{i}"], ref[f"greedy_{i}"][:-1]])
        kept, seg, span = hsr.segments(full.tolist(), BLOCK, pad=-1, ssep=-2, pdep=-3)
        assert span == [False] and len(kept) == len(full)
        got = hsr.reference_logprobs(lm.params, lm.cfg, kept, seg, span)
        err = np.abs(got - _log_softmax(ref[f"logits_{i}"])).max(-1)
        # HF ran in float32 (chunked torch GDN, weights of std 0.2): its rounding grows with
        # depth to ~2e-4 here, while the first tokens agree to ~1e-5 with this float64 reference
        assert err[:8].max() < 2e-5 and err.max() < 5e-4, f"prompt {i}: errors {err}"


def _block(rng, n_tok, marker=None):
    """One block: optional marker, n_tok random text tokens, pads to the block end."""
    body = ([marker] if marker is not None else []) + rng.integers(0, 240, n_tok).tolist()
    return body + [PAD] * (-len(body) % BLOCK)


def test_span_outputs_depend_on_the_span_only(fresh_rng):
    lm = _model()
    sys_a, sys_b = _block(fresh_rng, 9), _block(fresh_rng, 20)
    span1, span2 = _block(fresh_rng, 13, SSEP), _block(fresh_rng, 5, SSEP)
    question = _block(fresh_rng, 6, PDEP)
    runs = {}
    for name, prompt in (("a12", sys_a + span1 + span2 + question),
                         ("b21", sys_b + span2 + span1 + question)):
        kept, seg, span = hsr.segments(prompt, BLOCK, PAD, SSEP, PDEP)
        assert PAD not in kept and span == [False, True, True, False]
        runs[name] = (hsr.reference_logprobs(lm.params, lm.cfg, kept, seg, span), seg)

    def rows(name, seg_id):
        lp, seg = runs[name]
        return lp[seg == seg_id]
    # span1 is segment 1 in a12 and 2 in b21 (other offset, other order): the same outputs
    np.testing.assert_allclose(rows("a12", 1), rows("b21", 2), rtol=0, atol=1e-10)
    np.testing.assert_allclose(rows("a12", 2), rows("b21", 1), rtol=0, atol=1e-10)
    # the question sees everything before it: different prefixes give different outputs
    assert np.abs(rows("a12", 3) - rows("b21", 3)).max() > 1e-3


def test_composed_span_maps_give_the_reference_flow_state(fresh_rng):
    """At every GDN layer, the state entering each PDEP segment equals the composition of all
    earlier segments' maps, each from the chunked layer (fp32) over that segment's own delta
    inputs from a zero state: the engine's recipe, against the reference's token replay."""
    lm = _model()
    prompt = (_block(fresh_rng, 7) + _block(fresh_rng, 17, SSEP) + _block(fresh_rng, 2, SSEP)
              + _block(fresh_rng, 4, PDEP) + _block(fresh_rng, 30, SSEP)
              + _block(fresh_rng, 3, PDEP))
    kept, seg, span = hsr.segments(prompt, BLOCK, PAD, SSEP, PDEP)
    trace = []
    hsr.reference_logprobs(lm.params, lm.cfg, kept, seg, span, trace)
    width = 64  # every segment padded with no-op tokens (the identity map): one compile
    run = jax.jit(lambda *x: api.prefill(*x, chunk_size=16, return_transition=True)[1::2])
    replay = jax.jit(lambda *x: api.prefill(*x, chunk_size=16)[1])
    worst = worst32 = 0.0
    for layer in trace:
        maps = []
        for s_id in range(len(span)):
            b_span, a_span = run(*_segment_inputs(layer, seg == s_id, width))
            maps.append((a_span[0], b_span[0]))
            if not span[s_id] and s_id > 0:  # a PDEP segment: compose all earlier maps
                a = jnp.stack([m[0] for m in maps[:-1]])
                b = jnp.stack([m[1] for m in maps[:-1]])
                entering = np.asarray(affine.apply_chain(a, b, jnp.zeros_like(b[0])))
                # the fp32 replay: the chunked layer over all earlier tokens' delta inputs, each
                # segment from the state the previous one left (span-local chunk boundaries)
                state = np.zeros_like(entering)[None]
                for prev in range(s_id):
                    ins_prev = _segment_inputs(layer, seg == prev, width)
                    state = replay(*ins_prev, state)
                state = np.asarray(state[0])
                worst32 = max(worst32, _rel(entering, state))
                worst = max(worst, _rel(entering, layer["entering"][s_id]))
    print(f"composed entering states: worst rel vs fp32 replay {worst32:.2e}, "
          f"vs float64 reference {worst:.2e}")
    assert worst32 < 1e-6 and 0 < worst < 1e-4


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _segment_inputs(layer, rows, width):
    """One segment's delta inputs (q = k: unused for the state), padded with no-op tokens."""
    idx = np.flatnonzero(rows)
    k, v = np.asarray(layer["k"])[idx], np.asarray(layer["v"])[idx]
    pad = lambda x: np.pad(x, [(0, width - len(idx))] + [(0, 0)] * (x.ndim - 1))
    return [pad(x)[None].astype(np.float32)
            for x in (k, k, v, layer["g"][idx], layer["beta"][idx])]
