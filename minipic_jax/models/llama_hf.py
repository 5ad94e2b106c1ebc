"""Llama params <-> HF checkpoint tensors (torch Linear layout [out, in], HF tensor names).

Params are the family's pure dict (see llama_modules.py): {"embed", "layers": ({...}, ...),
"final_norm", "lm_head" (absent when tied)}; per layer wq [E, H, D], wk/wv [E, K, D],
wo [H, D, E], w_gate/w_up [E, F], w_down [F, E], norms [E].
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from minipic_jax.models.hf_weights import take

_LAYER_NAMES = {  # our name -> HF name under model.layers.{i}.
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight"}


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every checkpoint tensor convert_hf reads (and to_hf writes)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{n}" for n in _LAYER_NAMES.values()]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _layouts(cfg: ModelConfig) -> dict:
    """our name -> (HF shape, HF -> ours, ours -> HF) for the per-layer tensors."""
    e, h, k, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    same = (lambda w: w, lambda w: w)
    return {
        "attn_norm": ((e,),) + same, "mlp_norm": ((e,),) + same,
        "wq": ((h * d, e), lambda w: w.T.reshape(e, h, d), lambda w: w.reshape(e, h * d).T),
        "wk": ((k * d, e), lambda w: w.T.reshape(e, k, d), lambda w: w.reshape(e, k * d).T),
        "wv": ((k * d, e), lambda w: w.T.reshape(e, k, d), lambda w: w.reshape(e, k * d).T),
        "wo": ((e, h * d), lambda w: w.T.reshape(h, d, e), lambda w: w.reshape(h * d, e).T),
        "w_gate": ((f, e), lambda w: w.T, lambda w: w.T),
        "w_up": ((f, e), lambda w: w.T, lambda w: w.T),
        "w_down": ((e, f), lambda w: w.T, lambda w: w.T),
    }


def convert_hf(get_tensor, cfg: ModelConfig, dtype=jnp.float32, *, host: bool = False) -> dict:
    """HF tensors -> params dict in `dtype`. get_tensor(name) -> np.ndarray; shapes are checked
    (ValueError naming the tensor). host=True: the same tree of numpy views of the checkpoint
    tensors in our layout (checkpoint dtype, nothing copied), for streaming each tensor's shards
    to their devices (serving/step/sharding.py, stream_params)."""
    e, v = cfg.hidden_size, cfg.vocab_size

    def get(name, shape, fn=lambda x: x):
        if host:
            return fn(take(get_tensor, name, shape))
        # Transfer as stored (copied: never alias the memory map), then cast and re-layout on device.
        return fn(jnp.array(take(get_tensor, name, shape), copy=True).astype(dtype))

    lay = _layouts(cfg)
    layer_list = tuple(
        {n: get(f"model.layers.{i}.{hf}", lay[n][0], lay[n][1]) for n, hf in _LAYER_NAMES.items()}
        for i in range(cfg.num_layers))
    params = {"embed": get("model.embed_tokens.weight", (v, e)), "layers": layer_list,
              "final_norm": get("model.norm.weight", (e,))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", (v, e), lambda w: w.T)
    return params


def to_hf(params: dict, cfg: ModelConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """params dict (unfused) -> {HF tensor name: numpy array in `dtype`}: what convert_hf reads."""
    if any("wqkv" in lp for lp in params["layers"]):
        raise ValueError("to_hf: params are fused; export the unfused params")
    np_ = lambda a: np.asarray(jnp.asarray(a, jnp.float32)).astype(dtype)
    lay = _layouts(cfg)
    out = {"model.embed_tokens.weight": np_(params["embed"]),
           "model.norm.weight": np_(params["final_norm"])}
    for i, lp in enumerate(params["layers"]):
        for n, hf in _LAYER_NAMES.items():
            out[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(lay[n][2](np_(lp[n])))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np_(params["lm_head"]).T)
    return out
