"""The Qwen3.5 cache: KV pages for the full-attention layers and recurrent-state slots for the
Gated DeltaNet layers, and the hybrid hooks over those slots (take a state out, put one back)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from minipic_jax.models.qwen3_5_config import check
from minipic_jax.models.qwen3_5_gdn import gdn_dims, state_shapes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen35Cache:
    k: tuple[jax.Array, ...]  # one per full-attention layer: [P, B, K, D]
    v: tuple[jax.Array, ...]  # [P, B, K, D]
    conv: tuple[jax.Array, ...]  # one per GDN layer: [slots, C, Kc - 1] last conv inputs
    delta: tuple[jax.Array, ...]  # one per GDN layer: [slots, Hv, Dk, Dv] float32


def init_cache(cfg: ModelConfig, num_pages: int, block_size: int, max_num_seqs: int = 1,
               dtype=jnp.float32) -> Qwen35Cache:
    """Zeroed cache: KV pages for full-attention layers, max_num_seqs recurrent-state slots per
    GDN layer (conv state in `dtype`, delta state float32)."""
    check(cfg)
    kv = (num_pages, block_size, cfg.num_kv_heads, cfg.head_dim)
    n_attn = cfg.layer_types.count("full_attention")
    n_gdn = cfg.num_layers - n_attn
    conv_shape, delta_shape = state_shapes(cfg, max(max_num_seqs, 1))
    return Qwen35Cache(k=tuple(jnp.zeros(kv, dtype) for _ in range(n_attn)),
                       v=tuple(jnp.zeros(kv, dtype) for _ in range(n_attn)),
                       conv=tuple(jnp.zeros(conv_shape, dtype) for _ in range(n_gdn)),
                       delta=tuple(jnp.zeros(delta_shape, jnp.float32) for _ in range(n_gdn)))


def cache_axes(cfg: ModelConfig) -> Qwen35Cache:
    """Logical axis names per cache array (init_cache's structure)."""
    kv, n_attn = ("pages", "page", "kv_heads", "head_dim"), cfg.layer_types.count("full_attention")
    n_gdn = cfg.num_layers - n_attn
    return Qwen35Cache(k=(kv,) * n_attn, v=(kv,) * n_attn,
                       conv=(("slots", "gdn_conv", None),) * n_gdn,
                       delta=(("slots", "gdn_heads", None, None),) * n_gdn)


def state_nbytes(cfg: ModelConfig, conv_dtype=jnp.float32, delta_dtype=jnp.float32) -> dict:
    """Analytic size of one sequence's recurrent checkpoint (all GDN layers)."""
    hk, hv, dk, dv, c, kc = gdn_dims(cfg)
    n_gdn = cfg.layer_types.count("linear_attention")
    conv = c * (kc - 1) * jnp.dtype(conv_dtype).itemsize
    delta = hv * dk * dv * jnp.dtype(delta_dtype).itemsize
    return dict(per_layer_conv=conv, per_layer_delta=delta, per_layer=conv + delta,
                layers=n_gdn, total=n_gdn * (conv + delta))


def extract_state(cache: Qwen35Cache, slot: int) -> dict:
    """One slot's recurrent state as host numpy arrays: conv [Lg, C, Kc-1], delta [Lg, Hv, Dk, Dv]."""
    return dict(conv=np.stack([np.asarray(c[slot]) for c in cache.conv]),
                delta=np.stack([np.asarray(d[slot]) for d in cache.delta]))


def restore_state(cache: Qwen35Cache, slot: int, state: dict) -> Qwen35Cache:
    """Write a state from `extract_state` (or a checkpoint) into `slot`; returns the new cache."""
    n = len(cache.conv)
    if state["conv"].shape[0] != n or state["delta"].shape[0] != n:
        raise ValueError(f"restore_state: state has {state['conv'].shape[0]} conv / "
                         f"{state['delta'].shape[0]} delta layers, cache has {n} GDN layers")
    conv = tuple(c.at[slot].set(jnp.asarray(state["conv"][i], c.dtype))
                 for i, c in enumerate(cache.conv))
    delta = tuple(d.at[slot].set(jnp.asarray(state["delta"][i], d.dtype))
                  for i, d in enumerate(cache.delta))
    return dataclasses.replace(cache, conv=conv, delta=delta)


def read_states(cache: Qwen35Cache, slots):
    """Jit-able read of state slots [S]: conv [Lg, S, C, Kc-1], delta [Lg, S, Hv, Dk, Dv]
    (write_states' layout; the warm span path composes cached span maps onto them)."""
    return (jnp.stack([c[slots] for c in cache.conv]),
            jnp.stack([d[slots] for d in cache.delta]))


def state_layers(cache: Qwen35Cache) -> tuple[tuple, tuple]:
    """The GDN layers' state caches themselves (conv [slots, C, Kc-1] x Lg, delta [slots, Hv, Dk,
    Dv] x Lg), for kernels that move slots on in place (span_maps.enter)."""
    return cache.conv, cache.delta


def with_state_layers(cache: Qwen35Cache, conv, delta) -> Qwen35Cache:
    """The cache with state_layers' arrays replaced (the same structure)."""
    return dataclasses.replace(cache, conv=tuple(conv), delta=tuple(delta))


def write_states(cache: Qwen35Cache, slots, conv, delta, mask) -> Qwen35Cache:
    """Jit-able restore of checkpoints into state slots (the engine's hybrid prefix cache hook).

    slots [S] int32 state slots; conv [Lg, S, C, Kc-1], delta [Lg, S, Hv, Dk, Dv] the states to
    write; mask [S] bool which rows to write (others leave their slot untouched).
    """
    idx = jnp.where(mask, slots, cache.conv[0].shape[0] if cache.conv else 0)  # [S] OOB: dropped
    conv_new = tuple(c.at[idx].set(conv[i].astype(c.dtype), mode="drop")
                     for i, c in enumerate(cache.conv))
    delta_new = tuple(d.at[idx].set(delta[i].astype(d.dtype), mode="drop")
                      for i, d in enumerate(cache.delta))
    return dataclasses.replace(cache, conv=conv_new, delta=delta_new)
