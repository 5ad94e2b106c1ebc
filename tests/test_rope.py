"""RoPE frequencies and application vs HF transformers (fixtures) and vs a float64 rotation."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, LLAMA_FIXTURES, hf_reference

from configs.model_config import ModelConfig, RopeConfig
from kernels_pallas.rope import apply_rope
from minipic_jax.loading.hf_config import model_config_from_folder
from minipic_jax.models import rope

CASES = ("default", "llama3", "linear", "partial_default")


def _cfg_from_case(meta: dict) -> ModelConfig:
    kw = {k: meta[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings", "partial_rotary_factor")
          if k in meta}
    return ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=meta["head_dim"],
                       rope=RopeConfig(theta=meta["rope_theta"], rope_type=meta["rope_type"], **kw))


@pytest.mark.parametrize("case", CASES)
def test_rope_matches_hf_apply_rotary_pos_emb(case):
    ref = np.load(FIXTURES / "rope_cases.npz")
    cfg = _cfg_from_case(json.loads(bytes(ref[f"{case}_config"]).decode()))
    inv = rope.inv_freq(cfg)
    np.testing.assert_array_equal(inv, ref[f"{case}_inv_freq"])
    assert inv.shape == (cfg.rotary_dim // 2,)
    pos = jnp.asarray(ref["positions"])
    for t in ("q", "k"):
        out = apply_rope(jnp.asarray(ref[f"{case}_{t}"]), pos, inv, rope.attention_scaling(cfg))
        # Positions reach 131071; with inv_freq bit-equal to HF's only cos/sin rounding remains.
        np.testing.assert_allclose(np.asarray(out), ref[f"{case}_{t}_rot"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", LLAMA_FIXTURES)
def test_inv_freq_matches_model_buffer(name):
    _, _, cfg = model_config_from_folder(FIXTURES / name)
    np.testing.assert_array_equal(rope.inv_freq(cfg), hf_reference(FIXTURES / name)["inv_freq"])


def test_llama3_bands_against_float64_formula(fresh_rng):
    """llama3 scaling: low band divided by factor, high band untouched, middle interpolated."""
    theta = float(fresh_rng.choice([1e4, 5e5]))
    factor, low, high, ctx = 8.0, 1.0, 4.0, int(fresh_rng.integers(16, 4096))
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=128, rope=RopeConfig(
                          theta=theta, rope_type="llama3", factor=factor, low_freq_factor=low,
                          high_freq_factor=high, original_max_position_embeddings=ctx))
    base = 1.0 / theta ** (np.arange(0, 128, 2) / 128.0)
    wavelen = 2 * np.pi / base
    smooth = (ctx / wavelen - low) / (high - low)
    want = np.where(wavelen < ctx / high, base,
                    np.where(wavelen > ctx / low, base / factor,
                             (1 - smooth) * base / factor + smooth * base))
    np.testing.assert_allclose(rope.inv_freq(cfg), want, rtol=2e-6)


def test_partial_rotary_passes_tail_through_and_matches_float64(fresh_rng):
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=32, rope=RopeConfig(theta=1e4,
                                                                   partial_rotary_factor=0.25))
    inv = rope.inv_freq(cfg)
    assert inv.shape == (4,)
    x = fresh_rng.standard_normal((5, 2, 32)).astype(np.float32)
    pos = fresh_rng.integers(0, 5000, 5)
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), inv))
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    ang = pos[:, None].astype(np.float64) * inv.astype(np.float64)[None]  # [T, 4]
    x1, x2 = x[..., :4].astype(np.float64), x[..., 4:8].astype(np.float64)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    np.testing.assert_allclose(out[..., :8], want, atol=1e-4)


def test_unsupported_rope_type_is_named():
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=8, rope=RopeConfig(rope_type="yarn"))
    with pytest.raises(ValueError, match="yarn"):
        rope.inv_freq(cfg)
