"""Float32 models compute float32 dots: on a GPU XLA's default float32 dot is TF32 (operands
rounded to 10 mantissa bits), which put the Qwen3.5 fixture's logits 3.4e-2 off HF on the H200
(tests/test_qwen3_5.py::test_pallas_gdn_path_matches_hf asks 1e-4). Checked on CPU twice: every
dot of the traced forward asks HIGHEST (cheap), and (slow) HF parity with TF32 emulated: every
float32 dot_general traced at the default precision gets TF32-rounded operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from jaxpr_walk import outer_eqns
from jax._src.lax import lax as _lax

from minipic_jax.loading import load_model
from minipic_jax.models import qwen3_5, testing


def _tf32(x):
    """Round float32 to TF32 (10 explicit mantissa bits, round half up on the magnitude)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@pytest.fixture
def emulated_tf32(monkeypatch):
    """dot_general at the default precision with float32 operands -> TF32 operands (trace time:
    callers must trace afresh, e.g. a new jax.jit)."""
    bind = _lax.dot_general_p.bind

    def tf32_bind(lhs, rhs, **params):
        prec = params.get("precision")
        default = prec is None or all(p in (None, jax.lax.Precision.DEFAULT) for p in prec)
        if default and lhs.dtype == jnp.float32 and rhs.dtype == jnp.float32:
            lhs, rhs = _tf32(lhs), _tf32(rhs)
        return bind(lhs, rhs, **params)
    monkeypatch.setattr(_lax.dot_general_p, "bind", tf32_bind)


def _logits_error(forward, name="qwen3_5_gva2"):
    """Max abs logit error vs HF over the fixture's prompts (one ragged call, XLA GDN)."""
    lm = load_model(str(FIXTURES / name))
    ref = np.load(FIXTURES / name / "reference.npz")
    n = sum(1 for k in ref.files if k.startswith("prompt_"))
    full = [np.concatenate([ref[f"prompt_{i}"], ref[f"greedy_{i}"][:-1]]) for i in range(n)]
    pager = testing.SimplePager(n, max(map(len, full)), 16)
    cache = lm.family.init_cache(lm.cfg, pager.num_pages, 16, n, jnp.float32)
    md, _, total = pager.step([len(t) for t in full])
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:total] = np.concatenate(full)
    fwd = jax.jit(lambda p, t, m, c: forward(p, t, m, c, lm.cfg, gdn_impl="xla")[0])  # fresh
    logits = np.asarray(fwd(lm.params, jnp.asarray(tokens), md, cache))[:total]
    return np.abs(logits - np.concatenate([ref[f"logits_{i}"] for i in range(n)])).max()


def _dot_precisions(forward, name="qwen3_5_gva2"):
    """(precision, operand dtype) of every dot_general in forward's trace on the fixture (inside
    conditionals and loops too; Pallas kernel bodies are the kernels' own business)."""
    lm = load_model(str(FIXTURES / name))
    pager = testing.SimplePager(2, 20, 16)
    cache = lm.family.init_cache(lm.cfg, pager.num_pages, 16, 2, jnp.float32)
    md, _, _ = pager.step([10, 5])
    jaxpr = jax.make_jaxpr(lambda p, t, m, c: forward(p, t, m, c, lm.cfg)[0])(
        lm.params, jnp.zeros(md.num_tokens, jnp.int32), md, cache)
    return [(eqn.params["precision"], eqn.invars[0].aval.dtype)
            for eqn in outer_eqns(jaxpr.jaxpr) if eqn.primitive.name == "dot_general"]


def test_float32_forward_asks_ieee_dots():
    highest = (jax.lax.Precision.HIGHEST,) * 2
    found = _dot_precisions(qwen3_5.forward_with_checkpoints)
    assert found and all(p == highest and d == jnp.float32 for p, d in found), found
    # the control: without the policy the model's own projections are at the default precision
    unwrapped = qwen3_5.forward_with_checkpoints.__wrapped__
    assert any(p != highest for p, _ in _dot_precisions(unwrapped))


@pytest.mark.slow  # two compiled forwards (~20 s on 2 cores)
def test_float32_forward_matches_hf_under_emulated_tf32(emulated_tf32):
    # the control: the same forward without its float32 policy is far off (the emulation is live)
    assert _logits_error(qwen3_5.forward_with_checkpoints.__wrapped__) > 1e-2
    assert _logits_error(qwen3_5.forward_with_checkpoints) <= 1e-4


def test_bf16_params_keep_default_precision():
    from minipic_jax.models import layers
    x = jnp.ones((2, 2), jnp.bfloat16)
    with layers.float32_matmuls({"w": x}):
        assert jax.config.jax_default_matmul_precision is None
    with layers.float32_matmuls({"w": x.astype(jnp.float32), "i": jnp.zeros(2, jnp.int32)}):
        assert jax.config.jax_default_matmul_precision == "highest"
