"""Qwen3.5 with fused projections (qwen3_5.fuse_params, what the engine runs on one device): per
layer [qkv | z | b | a] of the GDN, [q | gate | k | v] of the attention, [gate | up] of the MLP.

Oracle: the HF reference fixtures of test_qwen3_5.py (float32 logits, with its float64
fallback; the engine's greedy tokens through fused params: its
test_llm_generate_matches_hf_with_chunked_prefill); the fused arrays hold the originals
exactly (unfuse_params round trip)."""

import jax
import numpy as np
from conftest import FIXTURES
from test_qwen3_5 import QWEN_FIXTURES, _ref, assert_hf_parity

from minipic_jax.loading import load_model
from minipic_jax.models import qwen3_5, testing
from minipic_jax.models import qwen3_5_modules as modules


def test_fused_params_match_hf_logits():
    name = QWEN_FIXTURES[0]
    m, ref = load_model(str(FIXTURES / name)), _ref(name)
    fused = qwen3_5.fuse_params(m.params)
    assert modules.is_fused(fused) and not modules.is_fused(m.params)
    kinds = [sorted(lp["mixer"]) for lp in fused["layers"]]
    assert all("w_in" in k or "wqgkv" in k for k in kinds), kinds
    full = [np.concatenate([p, g[:-1]]) for p, g in zip(ref["prompt"], ref["greedy"])]
    for i, got in enumerate(testing.prefill_logits(m.family, fused, m.cfg, full, page_size=16)):
        assert_hf_parity(name, i, got)


def test_fuse_consumes_the_originals_and_unfuse_gives_them_back(fresh_rng):
    cfg = load_model(str(FIXTURES / QWEN_FIXTURES[0])).cfg
    params = qwen3_5.init_params(cfg, jax.random.key(int(fresh_rng.integers(1 << 30))))
    leaves, tree = jax.tree.flatten(params)  # distinct values everywhere (init has ones)
    params = jax.tree.unflatten(tree, [x + 0.01 * i for i, x in enumerate(leaves)])
    want = jax.tree.map(np.asarray, params)
    gdn = next(lp for lp in params["layers"] if "w_qkv" in lp["mixer"])
    fused = qwen3_5.fuse_params(params, consume=True)
    assert gdn["mixer"]["w_z"].is_deleted() and gdn["w_up"].is_deleted()
    assert not gdn["mixer"]["w_out"].is_deleted() and not params["embed"].is_deleted()
    back = qwen3_5.unfuse_params(fused)
    assert jax.tree.structure(back) == tree
    for got, w in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), w)
    assert qwen3_5.fuse_params(fused)["layers"][0] is fused["layers"][0]  # fused: a no-op
    assert jax.tree.map(np.shape, fused) == modules.shapes(cfg, fused=True)
