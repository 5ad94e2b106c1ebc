"""The Llama family through `forward` and the paged cache vs HF transformers 5.24.0 outputs.

Oracle: tests/fixtures/<name>/reference.npz written by scripts/make_hf_fixtures.py (fp32 logits of
one HF forward over prompt + greedy continuation, and HF `generate(do_sample=False)` tokens).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, LLAMA_FIXTURES, REPO, hf_reference

from minipic_jax.loading import load_model
from minipic_jax.models import llama, testing

TOL = 1e-4


@pytest.fixture(scope="module", params=LLAMA_FIXTURES)
def fixture(request):
    folder = FIXTURES / request.param
    return load_model(folder), hf_reference(folder)


def test_prefill_logits_match_hf_in_one_ragged_call(fixture):
    m, ref = fixture
    got = testing.prefill_logits(m.family, m.params, m.cfg, ref["prompts"], page_size=4)
    for i, (g, want) in enumerate(zip(got, ref["logits"])):
        diff = np.abs(g - want[:len(g)]).max()
        assert diff <= TOL, f"prompt {i}: max |logits - HF| = {diff}"


def test_greedy_matches_hf_generate_through_paged_decode(fixture):
    m, ref = fixture
    max_new = max(len(g) for g in ref["greedy"])
    tokens, step_logits = testing.greedy_generate(m.family, m.params, m.cfg, ref["prompts"],
                                                  max_new, page_size=4)
    for i, prompt in enumerate(ref["prompts"]):
        assert tokens[i] == ref["greedy"][i], f"prompt {i}"
        # decode-step logits equal HF's full-forward logits at the same positions
        want = ref["logits"][i][len(prompt) - 1:len(prompt) - 1 + len(tokens[i])]
        assert np.abs(np.stack(step_logits[i]) - want).max() <= TOL


def test_chunked_prefill_matches_hf(fixture, fresh_rng):
    """The longest prompt prefilled in random chunks (later chunks attend to cached pages)."""
    m, ref = fixture
    prompt = ref["prompts"][-1]
    cuts = sorted(fresh_rng.choice(np.arange(1, len(prompt)), size=2, replace=False).tolist())
    chunks = [c for c in np.split(np.asarray(prompt), cuts) if len(c)]
    pager = testing.SimplePager(1, len(prompt), page_size=4, seed=int(fresh_rng.integers(1 << 30)))
    cache = m.family.init_cache(m.cfg, pager.num_pages, 4, 1, jnp.float32)
    fwd = testing.jitted_forward(m.family)
    rows = []
    for chunk in chunks:
        md, _, n = pager.step([len(chunk)])
        toks = np.zeros(md.num_tokens, np.int32)
        toks[:n] = chunk
        logits, cache = fwd(m.params, jnp.asarray(toks), md, cache, cfg=m.cfg)
        rows.append(np.asarray(logits)[:n])
    assert np.abs(np.concatenate(rows) - ref["logits"][-1][:len(prompt)]).max() <= TOL


def test_batch_of_different_lengths_equals_each_alone(fresh_rng):
    m = load_model(FIXTURES / "llama_gqa2_llama3rope")
    prompts = [fresh_rng.integers(0, 256, int(n)).tolist() for n in fresh_rng.integers(1, 20, 3)]
    kw = dict(page_size=4, max_len=32)
    batch = testing.prefill_logits(m.family, m.params, m.cfg, prompts, seed=1, **kw)
    batch_tok, batch_logits = testing.greedy_generate(m.family, m.params, m.cfg, prompts, 4,
                                                      stop_on_eos=False, seed=2, **kw)
    for i, p in enumerate(prompts):
        alone = testing.prefill_logits(m.family, m.params, m.cfg, [p], seed=3, **kw)[0]
        np.testing.assert_allclose(batch[i], alone, atol=1e-5, rtol=0)
        tok, logits = testing.greedy_generate(m.family, m.params, m.cfg, [p], 4,
                                              stop_on_eos=False, seed=4, **kw)
        assert tok[0] == batch_tok[i]
        np.testing.assert_allclose(np.stack(logits[0]), np.stack(batch_logits[i]), atol=1e-5)


def test_rotated_kv_mode_gives_the_same_logits(fresh_rng):
    m = load_model(FIXTURES / "llama_mha")
    prompts = [fresh_rng.integers(0, 256, int(n)).tolist() for n in (5, 9)]
    free = testing.greedy_generate(m.family, m.params, m.cfg, prompts, 4, stop_on_eos=False,
                                   max_len=16)
    rot = testing.greedy_generate(m.family, m.params, m.cfg, prompts, 4, stop_on_eos=False,
                                  kv_mode="rotated", max_len=16)
    assert free[0] == rot[0]
    for a, b in zip(free[1], rot[1]):
        np.testing.assert_allclose(np.stack(a), np.stack(b), atol=1e-5)


def test_jitted_forward_donates_cache_writes_only_its_slots_returns_all_rows():
    m = load_model(FIXTURES / "llama_gqa4_tied_hd16")
    pager = testing.SimplePager(1, 16, page_size=4, seed=0)
    cache = m.family.init_cache(m.cfg, pager.num_pages, 4, 1, jnp.float32)
    md, _, n = pager.step([6])
    toks = np.zeros(md.num_tokens, np.int32)
    toks[:n] = np.arange(6) + 40
    fwd = jax.jit(m.family.forward, static_argnames=("cfg", "kv_mode", "attn_impl"),
                  donate_argnames=("cache",))
    donated = jax.tree.leaves(cache)
    logits, cache = fwd(m.params, jnp.asarray(toks), md, cache, cfg=m.cfg)
    assert all(x.is_deleted() for x in donated)  # the cache really is donated (updated in place)
    assert logits.shape == (md.num_tokens, m.cfg.vocab_size) and logits.dtype == jnp.float32
    written = np.zeros(pager.num_pages * 4, bool)
    written[np.asarray(md.slot_mapping)[:n]] = True
    for k in cache.k + cache.v:
        rows = np.abs(np.asarray(k)).reshape(pager.num_pages * 4, -1).sum(-1) > 0
        np.testing.assert_array_equal(rows, written)


def test_param_axes_cover_every_param():
    for name in LLAMA_FIXTURES:
        m = load_model(FIXTURES / name)
        axes = m.family.param_axes(m.cfg)
        jax.tree.map(lambda x, ax: None if x.ndim == len(ax) else pytest.fail(f"{ax} {x.shape}"),
                     m.params, axes)
        assert jax.tree.structure(jax.eval_shape(
            lambda: llama.init_params(m.cfg, jax.random.key(0)))) == jax.tree.structure(m.params)


def test_bfloat16_load_runs_and_tracks_fp32():
    folder = FIXTURES / "llama_gqa2_llama3rope"
    ref = hf_reference(folder)
    m = load_model(folder, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(m.params))
    got = testing.prefill_logits(m.family, m.params, m.cfg, ref["prompts"], dtype=jnp.bfloat16)
    for g, want in zip(got, ref["logits"]):
        assert g.dtype == np.float32 and np.isfinite(g).all()
        want = want[:len(g)]
        # bf16 keeps 8 mantissa bits (0.4% per rounding); measured ~1-2% relative L2 here.
        assert np.linalg.norm(g - want) <= 0.04 * np.linalg.norm(want)


def _ref_python() -> str | None:
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    candidate = os.environ.get("MINIPIC_REF_PYTHON", str(REPO / ".venv-ref" / "bin" / "python"))
    return candidate if pathlib.Path(candidate).exists() else None


@pytest.mark.skipif(_ref_python() is None, reason="no torch (set MINIPIC_REF_PYTHON to a python "
                                                  "with torch + transformers 5.24.0)")
def test_live_random_config_matches_transformers(tmp_path, fresh_rng):
    """A fresh random config (GQA ratio, head_dim, rope type, tying) built by transformers now."""
    seed = int(fresh_rng.integers(1 << 30))
    out = subprocess.run([_ref_python(), str(REPO / "scripts" / "make_hf_fixtures.py"),
                          "--live", str(tmp_path), "--seed", str(seed)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = tmp_path / "llama_live"
    m, ref = load_model(folder), hf_reference(folder)
    got = testing.prefill_logits(m.family, m.params, m.cfg, ref["prompts"])
    for g, want in zip(got, ref["logits"]):
        assert np.abs(g - want[:len(g)]).max() <= TOL, f"seed {seed}"
    tokens, _ = testing.greedy_generate(m.family, m.params, m.cfg, ref["prompts"],
                                        max(len(g) for g in ref["greedy"]))
    assert tokens == ref["greedy"], f"seed {seed}"
