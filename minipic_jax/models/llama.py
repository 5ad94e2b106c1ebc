"""Llama family (Llama 2 / 3 / 3.1, Tulu 3, Mistral without sliding window): the family contract.

Implements `serving.model_contract.ModelFamily` over the Flax NNX modules of llama_modules.py,
used pure-functionally: params are a plain nested dict (leaves are arrays; per layer a dict,
layers a tuple) that jitted steps take as an argument and `llama_modules.bind` merges into the
module graph inside the trace. The KV cache is a registered dataclass pytree. Attention is
reached only through `kernels_pallas.paged_attention` (engine) or `training_forward`'s dense
masked attention (training). Shape letters: configs/model_config.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from kernels_pallas.paged_attention.api import KV_MODES
from minipic_jax.models import layers
from minipic_jax.models import llama_modules as modules
from minipic_jax.models import rope
from minipic_jax.models.paged_cache import paged_attend
from minipic_jax.models.llama_config import (ARCHITECTURES, MODEL_TYPES, config_from_hf,
                                             to_hf_config)
from minipic_jax.models.llama_hf import convert_hf, hf_tensor_names, to_hf
from minipic_jax.models.llama_train import training_forward
from minipic_jax.models.param_fusion import fuse_layers
from minipic_jax.models.param_init import init_from_shapes

IS_HYBRID = False

__all__ = ["ARCHITECTURES", "IS_HYBRID", "MODEL_TYPES", "KVCache", "config_from_hf", "convert_hf",
           "forward", "fuse_params", "hf_tensor_names", "init_cache", "init_params", "param_axes",
           "to_hf", "to_hf_config", "training_forward", "unfuse_params"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # L x [P, B, K, D] keys (unrotated in position_free mode)
    v: tuple[jax.Array, ...]  # L x [P, B, K, D]


# ----------------------------------------------------------------------------- params


def param_axes(cfg: ModelConfig, *, fused: bool = False) -> dict:
    """Logical axis names per param (same structure as the params; leaves are tuples of names),
    read from the Flax modules' annotations."""
    return modules.logical_axes(cfg, fused=fused)


def init_params(cfg: ModelConfig, key, dtype=jnp.float32) -> dict:
    """Deterministic random weights (normal, std 0.02; norms 1) from `key`."""
    return init_from_shapes(modules.shapes(cfg), key, dtype)


@jax.jit
def _fuse_layer(lp: dict) -> dict:
    return {"attn_norm": lp["attn_norm"], "wo": lp["wo"], "mlp_norm": lp["mlp_norm"],
            "w_down": lp["w_down"],
            "wqkv": jnp.concatenate([lp["wq"], lp["wk"], lp["wv"]], axis=1),
            "w_gate_up": jnp.concatenate([lp["w_gate"], lp["w_up"]], axis=1)}


def fuse_params(params: dict, *, consume: bool = False) -> dict:
    """Params with fused QKV and gate/up projections (fewer, larger GEMMs per layer; the same
    products, so outputs agree up to the GEMM's accumulation order). Done one layer at a time;
    with consume=True each original layer's arrays are deleted once fused, so peak memory grows
    by one layer only (the caller must hold no other reference to `params`)."""
    names = ("wq", "wk", "wv", "w_gate", "w_up")
    return fuse_layers(params, _fuse_layer, lambda lp: [lp[n] for n in names],
                       lambda lp: "wqkv" in lp, consume=consume)


def unfuse_params(params: dict) -> dict:
    """fuse_params undone (slices of the fused arrays; unfused layers pass through)."""
    def one(lp):
        if "wqkv" not in lp:
            return lp
        f = lp["w_down"].shape[0]
        nh = lp["wo"].shape[0]
        nk = (lp["wqkv"].shape[1] - nh) // 2
        wqkv, gu = lp["wqkv"], lp["w_gate_up"]
        return {"attn_norm": lp["attn_norm"], "wq": wqkv[:, :nh], "wk": wqkv[:, nh:nh + nk],
                "wv": wqkv[:, nh + nk:], "wo": lp["wo"], "mlp_norm": lp["mlp_norm"],
                "w_gate": gu[:, :f], "w_up": gu[:, f:], "w_down": lp["w_down"]}
    return {**params, "layers": tuple(one(lp) for lp in params["layers"])}


# ----------------------------------------------------------------------------- engine step


def init_cache(cfg: ModelConfig, num_pages: int, block_size: int, max_num_seqs: int = 0,
               dtype=jnp.float32) -> KVCache:
    """Zeroed paged KV cache: per layer k/v [P, B, K, D]. (max_num_seqs is unused here.)"""
    shape = (num_pages, block_size, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def cache_axes(cfg: ModelConfig) -> KVCache:
    """Logical axis names per cache array (init_cache's structure)."""
    kv = ("pages", "page", "kv_heads", "head_dim")
    return KVCache(k=(kv,) * cfg.num_layers, v=(kv,) * cfg.num_layers)


@layers.exact_float32  # float32 params: IEEE dots on a GPU too (HF parity), as Qwen3.5's
def forward(params: dict, tokens, metadata, cache: KVCache, cfg: ModelConfig, *,
            recurrent=None, logits_indices=None, kv_mode: str = "position_free",
            attn_impl: str | None = None, write_impl: str | None = None,
            attn_options: dict | None = None):
    """One ragged step: writes this step's K/V into the cache and returns logits.

    Args:
      params: the params dict (unfused or fused by `fuse_params`).
      tokens: [T] int32 (flat over the batch, bucket padding allowed).
      metadata: kernels_pallas AttentionMetadata for these T tokens.
      cache: KVCache (donate it when jitting).
      cfg: static ModelConfig.
      recurrent: unused (pure-attention model).
      logits_indices: [N] int32 rows of T to compute logits for; None = all rows.
      kv_mode: "position_free" (keys stored unrotated) or "rotated".
      attn_impl: paged_attention implementation (None = best available).
      write_impl: write_kv implementation (None = best available).
      attn_options: paged_attention kernel_options of the named attn_impl (typed options or a dict).
    Returns:
      (logits [N, V] float32, updated KVCache).
    """
    del recurrent
    if kv_mode not in KV_MODES:
        raise ValueError(f"forward: kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
    model = modules.bind(params, cfg)
    inv = rope.inv_freq(cfg)  # [R/2] numpy: a host constant (kernels build cos|sin tables once)
    attend = paged_attend(metadata, inv, attention_scaling=rope.attention_scaling(cfg),
                          kv_mode=kv_mode, attn_impl=attn_impl, write_impl=write_impl,
                          attn_options=attn_options)
    x = model.embed_tokens(tokens)  # [T, E]
    new_k, new_v = [], []
    for i, block in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            x, (kp, vp) = block(x, cfg, attend, (cache.k[i], cache.v[i]))
        new_k.append(kp)
        new_v.append(vp)
    with jax.named_scope("lm_head"):
        if logits_indices is not None:
            x = x[logits_indices]  # [N, E]
        logits = model.logits(x, cfg)  # [N, V] float32
    return logits, KVCache(k=tuple(new_k), v=tuple(new_v))

