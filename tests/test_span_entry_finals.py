"""A warm span step's local pass with entries (pieces continuing a long span start from their
entry's B: serving/hybrid/span_partial.py) gathers no initial states for its final pieces (issue
29: a warm step's work that produces nothing used). Its initial states are [1 + Mc] (zero, then
each capture's entry B) picked by a remapped seq_of_chunk, and a final piece's state falls back to
its initial state only where the piece is empty: that used to be a [S + Mc, Hv, Dk, Dv] gather
per GDN layer, by piece ids the states are not keyed by. An empty piece ends in state 0 (zero)
now; no empty piece is read (carried and captured pieces hold span rows), and the values are the
span tests' (test_span_partial.py, test_qwen3_5_spans.py against the float64 reference)."""

import jax
import jax.numpy as jnp

from benchmarks import span_step_work as work
from jaxpr_walk import outer_eqns
from minipic_jax.models import qwen3_5
from serving.hybrid import span_step

T, S = 128, 4


def test_warm_local_pass_gathers_no_initial_states_per_final_piece():
    cfg = work.model_cfg(1)
    md, logits_idx, f, rec = work.step_inputs(cfg, "warm", 2, t=T, s=S)
    params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 16 * 40, 16, S, jnp.bfloat16))
    maps = jax.eval_shape(lambda: work.pool(cfg, 4))
    jaxpr = jax.make_jaxpr(lambda p, c, m: qwen3_5.forward_with_checkpoints(
        p, jnp.zeros(md.num_tokens, jnp.int32), md, c, cfg, recurrent=rec,
        logits_indices=logits_idx, gdn_impl="pallas_fused_interpret",
        span_pieces=span_step.pieces(f, m, True, T, S)))(params, cache, maps).jaxpr
    states = (1 + span_step.MAX_CAPTURES, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
              cfg.linear_value_head_dim)
    gathers = [e for e in outer_eqns(jaxpr) if e.primitive.name == "gather"
               and tuple(e.invars[0].aval.shape) == states]
    assert not gathers, [tuple(e.outvars[0].aval.shape) for e in gathers]
