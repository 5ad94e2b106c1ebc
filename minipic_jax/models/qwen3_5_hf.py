"""HF checkpoint tensors <-> Qwen3.5 params (Qwen3_5ForCausalLM, or the composite
Qwen3_5ForConditionalGeneration whose text weights live under `model.language_model.`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from minipic_jax.models.hf_weights import take
from minipic_jax.models.qwen3_5_gdn import gdn_dims

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log",
        "norm", "out_proj")


def _prefix(cfg: ModelConfig) -> str:
    return "model.language_model." if cfg.model_type == "qwen3_5" else "model."


def _mixer_names(cfg, i):
    p = f"{_prefix(cfg)}layers.{i}."
    if cfg.layer_types[i] == "full_attention":
        return {n: f"{p}self_attn.{n}.weight" for n in _ATTN}
    return {n: f"{p}linear_attn.{n}" + ("" if n in ("dt_bias", "A_log") else ".weight")
            for n in _GDN}


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every checkpoint tensor convert_hf reads."""
    p = _prefix(cfg)
    names = [p + "embed_tokens.weight", p + "norm.weight"]
    for i in range(cfg.num_layers):
        lp = f"{p}layers.{i}."
        names += [lp + "input_layernorm.weight", lp + "post_attention_layernorm.weight",
                  lp + "mlp.gate_proj.weight", lp + "mlp.up_proj.weight",
                  lp + "mlp.down_proj.weight"]
        names += list(_mixer_names(cfg, i).values())
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def convert_hf(get_tensor, cfg: ModelConfig, dtype=jnp.float32, *, host: bool = False):
    """HF tensors (torch Linear layout [out, in]) -> the params dict in `dtype` (shapes checked;
    the layout of qwen3_5_modules). host=True: the same tree of numpy views of the checkpoint
    tensors in our layout (checkpoint dtype, nothing copied), for streaming each tensor's shards
    to their devices (serving/step/sharding.py, stream_params)."""
    e, h, k, d, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    hk, hv, dk, dv, c, kc = gdn_dims(cfg)

    def arr(x):
        return x if host else jnp.asarray(np.ascontiguousarray(x), dtype=dtype)

    def get(name, shape, fn=lambda x: x):
        return arr(fn(take(get_tensor, name, shape)))

    p = _prefix(cfg)
    lays = []
    for i in range(cfg.num_layers):
        lp = f"{p}layers.{i}."
        n = _mixer_names(cfg, i)
        if cfg.layer_types[i] == "full_attention":
            q_full = take(get_tensor, n["q_proj"], (h * 2 * d, e)).T.reshape(e, h, 2 * d)
            mixer = dict(
                wq=arr(q_full[..., :d]), wgate=arr(q_full[..., d:]),
                wk=get(n["k_proj"], (k * d, e), lambda w: w.T.reshape(e, k, d)),
                wv=get(n["v_proj"], (k * d, e), lambda w: w.T.reshape(e, k, d)),
                wo=get(n["o_proj"], (e, h * d), lambda w: w.T.reshape(h, d, e)),
                q_norm=get(n["q_norm"], (d,)), k_norm=get(n["k_norm"], (d,)))
        else:
            mixer = dict(
                w_qkv=get(n["in_proj_qkv"], (c, e), lambda w: w.T),
                w_z=get(n["in_proj_z"], (hv * dv, e), lambda w: w.T.reshape(e, hv, dv)),
                w_b=get(n["in_proj_b"], (hv, e), lambda w: w.T),
                w_a=get(n["in_proj_a"], (hv, e), lambda w: w.T),
                conv_w=get(n["conv1d"], (c, 1, kc), lambda w: w[:, 0, :]),
                dt_bias=get(n["dt_bias"], (hv,)), a_log=get(n["A_log"], (hv,)),
                norm=get(n["norm"], (dv,)),
                w_out=get(n["out_proj"], (e, hv * dv), lambda w: w.T.reshape(hv, dv, e)))
        lays.append(dict(
            attn_norm=get(lp + "input_layernorm.weight", (e,)), mixer=mixer,
            mlp_norm=get(lp + "post_attention_layernorm.weight", (e,)),
            w_gate=get(lp + "mlp.gate_proj.weight", (f, e), lambda w: w.T),
            w_up=get(lp + "mlp.up_proj.weight", (f, e), lambda w: w.T),
            w_down=get(lp + "mlp.down_proj.weight", (e, f), lambda w: w.T)))
    params = dict(embed=get(p + "embed_tokens.weight", (v, e)), layers=tuple(lays),
                  final_norm=get(p + "norm.weight", (e,)))
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", (v, e), lambda w: w.T)
    return params
