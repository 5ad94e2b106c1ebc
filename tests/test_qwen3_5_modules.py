"""Qwen3.5 as Flax NNX modules: the logical axes come from the nnx.Param annotations and cover
the params the HF converter and init_params build (same structure, one name per dimension)."""

import jax
import pytest
from conftest import FIXTURES

from minipic_jax.loading import load_model
from minipic_jax.models import qwen3_5


def _names(a):
    return isinstance(a, tuple) and all(n is None or isinstance(n, str) for n in a)


@pytest.mark.parametrize("name", ["qwen3_5_gva2", "qwen3_5_tied"])
def test_param_axes_come_from_the_flax_annotations(name):
    m = load_model(FIXTURES / name, cache_dir=False)
    axes = qwen3_5.param_axes(m.cfg)
    assert jax.tree.structure(axes, is_leaf=_names) == jax.tree.structure(m.params)
    assert jax.tree.structure(jax.eval_shape(
        lambda: qwen3_5.init_params(m.cfg, jax.random.key(0)))) == jax.tree.structure(m.params)
    jax.tree.map(lambda w, ax: None if w.ndim == len(ax) else pytest.fail(f"{ax} {w.shape}"),
                 m.params, axes)
    kinds = {t: m.cfg.layer_types.index(t) for t in qwen3_5.LAYER_TYPES}
    attn = axes["layers"][kinds["full_attention"]]["mixer"]
    gdn = axes["layers"][kinds["linear_attention"]]["mixer"]
    assert attn["wgate"] == ("embed", "heads", "head_dim")
    assert attn["wk"] == ("embed", "kv_heads", "head_dim") and attn["k_norm"] == ("head_dim",)
    assert gdn["w_z"] == ("embed", "gdn_heads", "gdn_v") and gdn["conv_w"] == ("gdn_conv", None)
    assert gdn["w_out"] == ("gdn_heads", "gdn_v", "embed")
    assert ("lm_head" in m.params) == (not m.cfg.tie_word_embeddings)
    assert ("lm_head" in axes) == (not m.cfg.tie_word_embeddings)
