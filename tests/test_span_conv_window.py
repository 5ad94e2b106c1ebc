"""A hybrid span step's GDN layer builds one conv window per row and runs one conv (issue 29: work
in a span step beyond what its tokens need): a span row's window is its piece's, any other row's
the flow's, chosen by index once per step (qwen3_5_spans.with_windows). It used to run the flow's
conv over every row and the local one over every row again, then keep one of the two per row
(2 convs of [T, C, Kc] per GDN layer, the same values). Counted on the traced step at the
qwen3_5_0_8b widths; the values are the span tests' (test_engine_hybrid_spans.py and others
against the float64 reference)."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.span_step_ops import model_cfg, step_inputs
from jaxpr_walk import outer_eqns
from minipic_jax.models import qwen3_5

T, S = 128, 4


def _conv_dots(kind: str) -> int:
    """dot_generals over a [T, C, Kc] window in a step with one GDN layer."""
    cfg = model_cfg(1)
    md, logits_idx, pieces, rec = step_inputs(T, S, kind == "capture", np.random.default_rng(0))
    params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 16 * 40, 16, S, jnp.bfloat16))
    jaxpr = jax.make_jaxpr(lambda p, c: qwen3_5.forward_with_checkpoints(
        p, jnp.zeros(md.num_tokens, jnp.int32), md, c, cfg, recurrent=rec,
        logits_indices=logits_idx, gdn_impl="pallas_fused_interpret",
        span_pieces=None if kind == "plain" else pieces))(params, cache).jaxpr
    c = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
        + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    window = (T, c, cfg.linear_conv_kernel_dim)
    return sum(1 for e in outer_eqns(jaxpr) if e.primitive.name == "dot_general"
               and any(tuple(getattr(v.aval, "shape", ())) == window for v in e.invars))


def test_a_span_step_runs_one_conv_per_gdn_layer_like_a_plain_step():
    assert _conv_dots("plain") == 1
    assert _conv_dots("span") == 1
    assert _conv_dots("capture") == 1
