"""Fused QKV / gate-up Llama weights (llama.fuse_params, what the engine runs) vs HF transformers.

Oracle: the same HF reference fixtures as test_llama_parity.py (fp32 logits and greedy tokens).
"""

import jax
import numpy as np
import pytest
from conftest import FIXTURES, LLAMA_FIXTURES, hf_reference

from minipic_jax.loading import load_model
from minipic_jax.models import llama, testing

TOL = 1e-4


@pytest.mark.parametrize("name", LLAMA_FIXTURES[1:3])
def test_fused_params_match_hf_prefill_and_greedy(name):
    m, ref = load_model(FIXTURES / name), hf_reference(FIXTURES / name)
    fused = llama.fuse_params(m.params)
    assert all(set(lp) == {"attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"}
               for lp in fused["layers"])
    got = testing.prefill_logits(m.family, fused, m.cfg, ref["prompts"], page_size=4)
    for i, (g, want) in enumerate(zip(got, ref["logits"])):
        assert np.abs(g - want[:len(g)]).max() <= TOL, f"prompt {i}"
    max_new = max(len(g) for g in ref["greedy"])
    tokens, _ = testing.greedy_generate(m.family, fused, m.cfg, ref["prompts"], max_new,
                                        page_size=4)
    for i, want in enumerate(ref["greedy"]):
        assert tokens[i] == want, f"prompt {i}"


def test_fuse_params_consume_deletes_only_fused_originals(fresh_rng):
    cfg = load_model(FIXTURES / LLAMA_FIXTURES[0]).cfg
    params = llama.init_params(cfg, jax.random.key(int(fresh_rng.integers(1 << 30))))
    # two layers sharing one layer dict: its arrays are deleted only after the last use
    params = {**params, "layers": (params["layers"][0],) * 2 + params["layers"][2:]}
    lp0 = params["layers"][0]
    want = {n: np.asarray(lp0[n]) for n in ("wq", "wk", "wv", "w_gate", "w_up")}
    wo0 = lp0["wo"]
    fused = llama.fuse_params(params, consume=True)
    np.testing.assert_array_equal(np.asarray(fused["layers"][1]["wqkv"])[:, :cfg.num_heads],
                                  want["wq"])
    unfused = llama.unfuse_params(fused)["layers"][1]  # the unfused names come back as slices
    for n, w in want.items():
        np.testing.assert_array_equal(np.asarray(unfused[n]), w)
    assert lp0["wq"].is_deleted() and lp0["w_up"].is_deleted()
    assert not wo0.is_deleted() and not params["embed"].is_deleted()
    # fusing again is a no-op on fused layers
    assert llama.fuse_params(fused)["layers"][0] is fused["layers"][0]


def test_param_axes_come_from_the_flax_annotations_fused_too():
    cfg = load_model(FIXTURES / LLAMA_FIXTURES[2]).cfg  # tied embeddings: no lm_head
    params = llama.init_params(cfg, jax.random.key(0))
    for fused, p in ((False, params), (True, llama.fuse_params(params))):
        axes = llama.param_axes(cfg, fused=fused)
        names = lambda a: isinstance(a, tuple) and all(isinstance(n, str) for n in a)
        assert jax.tree.structure(axes, is_leaf=names) == jax.tree.structure(p)
        jax.tree.map(lambda w, ax: None if w.ndim == len(ax) else pytest.fail(f"{ax} {w.shape}"),
                     p, axes)
    assert llama.param_axes(cfg)["layers"][0]["wk"] == ("embed", "kv_heads", "head_dim")
    assert llama.param_axes(cfg, fused=True)["layers"][0]["wqkv"] == (
        "embed", "qkv_heads", "head_dim")
    assert "lm_head" not in params and llama.param_axes(cfg)["embed"] == ("vocab", "embed")
