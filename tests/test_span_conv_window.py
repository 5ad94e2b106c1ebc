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
import pytest

from benchmarks.span_step_ops import model_cfg, step_inputs
from jaxpr_walk import outer_eqns
from minipic_jax.models import qwen3_5, qwen3_5_gdn

T, S = 128, 4


def _convs(kind: str, monkeypatch) -> int:
    """Convs of [T, C] rows (qwen3_5_gdn.conv_rows_silu calls, Kc inputs each) traced in a step
    with one GDN layer."""
    cfg = model_cfg(1)
    md, logits_idx, pieces, rec = step_inputs(T, S, kind == "capture", np.random.default_rng(0))
    params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 16 * 40, 16, S, jnp.bfloat16))
    c = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
        + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    calls, conv = [], qwen3_5_gdn.conv_rows_silu

    def counted(rows, conv_w):
        if len(rows) == cfg.linear_conv_kernel_dim and all(r.shape == (T, c) for r in rows):
            calls.append(1)
        return conv(rows, conv_w)
    monkeypatch.setattr(qwen3_5_gdn, "conv_rows_silu", counted)
    jax.make_jaxpr(lambda p, c: qwen3_5.forward_with_checkpoints(
        p, jnp.zeros(md.num_tokens, jnp.int32), md, c, cfg, recurrent=rec,
        logits_indices=logits_idx, gdn_impl="pallas_fused_interpret",
        span_pieces=None if kind == "plain" else pieces))(params, cache)
    return len(calls)


def test_a_span_step_runs_one_conv_per_gdn_layer_like_a_plain_step(monkeypatch):
    assert _convs("plain", monkeypatch) == 1
    assert _convs("span", monkeypatch) == 1
    assert _convs("capture", monkeypatch) == 1


@pytest.mark.parametrize("row_sum", [True, False])
def test_the_conv_forms_agree(monkeypatch, row_sum):
    """conv_rows_silu's two forms (CONV_ROW_SUM: the taps summed in order; else the einsum over
    the window) against a float64 conv of the same inputs: each within float32 rounding."""
    rng = np.random.default_rng(0)
    rows = [jnp.asarray(rng.standard_normal((9, 24)), jnp.bfloat16) for _ in range(4)]
    w = rng.standard_normal((24, 4)).astype(np.float32)
    monkeypatch.setattr(qwen3_5_gdn, "CONV_ROW_SUM", row_sum)
    got = np.asarray(qwen3_5_gdn.conv_rows_silu(rows, jnp.asarray(w)))
    x = sum(np.asarray(r, np.float64) * w[:, i].astype(np.float64) for i, r in enumerate(rows))
    want = x / (1 + np.exp(-x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shifted_taps_read_the_values_the_gathers_read(monkeypatch):
    """CONV_SHIFTED (the taps as static shifts of the step's rows, else the conv state's rows)
    against the gathers (`history_rows`): the same conv, bit for bit, over a ragged batch whose
    sequences start before, at and after their conv windows' reach (and a padding tail)."""
    rng = np.random.default_rng(1)
    c, k1 = 24, 3
    lens, pos0 = np.array([5, 1, 2, 9, 0]), np.array([7, 0, 1, 30, 4])
    cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
    t = int(lens.sum()) + 3
    x = jnp.asarray(rng.standard_normal((t, c)), jnp.float32)
    conv0 = jnp.asarray(rng.standard_normal((5, c, k1)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((c, k1 + 1)), jnp.float32)
    seq_of_row = qwen3_5_gdn.rows_of_seqs(cu, t)
    outs = []
    for shifted, stacked in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(qwen3_5_gdn, "CONV_SHIFTED", shifted)
        monkeypatch.setattr(qwen3_5_gdn, "CONV_STACKED_GATHER", stacked)
        outs.append(np.asarray(qwen3_5_gdn.causal_conv(x, w, conv0, cu, jnp.asarray(pos0),
                                                       seq_of_row)))
    for out in outs[1:]:  # CONV_STACKED_GATHER (one gather a tap, no select) too
        np.testing.assert_array_equal(outs[0][:int(lens.sum())], out[:int(lens.sum())])
