"""Qwen3.5 params and cache pytrees (shared by the model, qwen3_5.py, and the HF converter,
qwen3_5_hf.py, so neither imports the other's module)."""

from __future__ import annotations

import dataclasses

import jax

from minipic_jax.models.qwen3_5_gdn import GDNParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttnParams:
    wq: jax.Array  # [E, H, D]
    wgate: jax.Array  # [E, H, D] output gate (second half of HF q_proj per head)
    wk: jax.Array  # [E, K, D]
    wv: jax.Array  # [E, K, D]
    wo: jax.Array  # [H, D, E]
    q_norm: jax.Array  # [D] (1 + w)
    k_norm: jax.Array  # [D] (1 + w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array  # [E] (1 + w)
    mixer: AttnParams | GDNParams
    mlp_norm: jax.Array  # [E] (1 + w)
    w_gate: jax.Array  # [E, F]
    w_up: jax.Array  # [E, F]
    w_down: jax.Array  # [F, E]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen35Params:
    embed: jax.Array  # [V, E]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [E] (1 + w)
    lm_head: jax.Array | None  # [E, V]; None when tied


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen35Cache:
    k: tuple[jax.Array, ...]  # one per full-attention layer: [P, B, K, D]
    v: tuple[jax.Array, ...]  # [P, B, K, D]
    conv: tuple[jax.Array, ...]  # one per GDN layer: [slots, C, Kc - 1] last conv inputs
    delta: tuple[jax.Array, ...]  # one per GDN layer: [slots, Hv, Dk, Dv] float32
