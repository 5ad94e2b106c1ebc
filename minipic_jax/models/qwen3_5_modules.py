"""The Qwen3.5 text model (Gated DeltaNet + gated full attention) as Flax NNX modules, used
pure-functionally.

The modules own the math and the parameter metadata (shapes and logical sharding axes); params
are a plain nested dict that jitted steps take as an argument and `bind` merges into the cached
graph definition inside the trace (nnx_pure.py says how). Per layer the dict holds `attn_norm`,
`mixer` (GatedAttention's or qwen3_5_gdn.GatedDeltaNet's weights, by cfg.layer_types),
`mlp_norm` and the SwiGLU MLP. Every RMSNorm here multiplies by (1 + w), as HF's Qwen3.5 does,
except the GDN's gated norm.

A block does not know its cache: the caller hands it `mix(mixer, h) -> (out [T, E], aux)`, which
runs the layer's token mixer against the caller's state (the engine's paged KV or recurrent slots)
and returns what the caller keeps (the updated cache entries). Shape letters:
configs/model_config.py.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model_config import ModelConfig
from minipic_jax.models import layers, nnx_pure
from minipic_jax.models.nnx_pure import param
from minipic_jax.models.param_fusion import all_fused
from minipic_jax.models.qwen3_5_config import check
from minipic_jax.models.qwen3_5_gdn import GatedDeltaNet

# attend(q [T, H, D], k [T, K, D], v [T, K, D], kv_state) -> (attn [T, H, D], kv_state)
Attend = Callable


class GatedAttention(nnx.Module):
    """Full attention with q/k RMSNorm and a sigmoid output gate (the second half of HF's q_proj
    per head). Rotary (partial) is the attention call's: keys reach it unrotated."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, fused: bool = False):
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads = h, k
        if fused:  # [wq | wgate | wk | wv] over heads: one GEMM (qwen3_5.fuse_params)
            self.wqgkv = param((e, 2 * h + 2 * k, d), ("embed", "qkv_heads", "head_dim"), dtype)
        else:
            self.wq = param((e, h, d), ("embed", "heads", "head_dim"), dtype)
            self.wgate = param((e, h, d), ("embed", "heads", "head_dim"), dtype)
            self.wk = param((e, k, d), ("embed", "kv_heads", "head_dim"), dtype)
            self.wv = param((e, k, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.wo = param((h, d, e), ("heads", "head_dim", "embed"), dtype)
        self.q_norm = param((d,), ("head_dim",), dtype)
        self.k_norm = param((d,), ("head_dim",), dtype)

    def projections(self, h):
        """(q, gate [T, H, D], k, v [T, K, D]) before the norms (h: rows or a layers.Normed)."""
        if not hasattr(self, "wqgkv"):
            return tuple(jnp.einsum("te,end->tnd", layers.normed(h), w[...])
                         for w in (self.wq, self.wgate, self.wk, self.wv))
        nh, nk = self.num_heads, self.num_kv_heads
        x = layers.project_heads(h, self.wqgkv[...])  # [T, 2H + 2K, D] (a Normed's norm in it)
        return x[:, :nh], x[:, nh:2 * nh], x[:, 2 * nh:2 * nh + nk], x[:, 2 * nh + nk:]

    def __call__(self, h, cfg: ModelConfig, attend: Attend, kv_state):
        """h [T, E] normed (or a layers.Normed) -> (out [T, E] or a layers.Projected, kv_state
        as `attend` returns it)."""
        eps = cfg.rms_norm_eps
        q, gate, k, v = self.projections(h)
        q = layers.rms_norm(q, self.q_norm[...], eps, unit_offset=True)  # [T, H, D]
        k = layers.rms_norm(k, self.k_norm[...], eps, unit_offset=True)  # [T, K, D]
        attn, kv_state = attend(q, k, v, kv_state)  # [T, H, D]
        attn = attn * jax.nn.sigmoid(gate)
        return layers.heads_projection(attn, self.wo[...], h), kv_state


class Qwen35Block(nnx.Module):
    """One decoder layer: pre-norm token mixer (attention or GDN) and pre-norm SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, layer_type: str, dtype=jnp.float32, *,
                 fused: bool = False):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.attn_norm = param((e,), ("embed",), dtype)
        self.mixer = (GatedAttention(cfg, dtype, fused=fused) if layer_type == "full_attention"
                      else GatedDeltaNet(cfg, dtype, fused=fused))
        self.mlp_norm = param((e,), ("embed",), dtype)
        if fused:  # [w_gate | w_up] over F: one GEMM (qwen3_5.fuse_params)
            self.w_gate_up = param((e, 2 * f), ("embed", "mlp"), dtype)
        else:
            self.w_gate = param((e, f), ("embed", "mlp"), dtype)
            self.w_up = param((e, f), ("embed", "mlp"), dtype)
        self.w_down = param((f, e), ("mlp", "embed"), dtype)

    def mlp(self, h):
        """The SwiGLU MLP of normed h [T, E]."""
        if not hasattr(self, "w_gate_up"):
            return layers.swiglu_mlp(h, self.w_gate[...], self.w_up[...], self.w_down[...])
        f = self.w_down.shape[0]
        gate_up = jnp.einsum("te,ef->tf", h, self.w_gate_up[...])  # [T, 2F]
        return jnp.einsum("tf,fe->te", jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:],
                          self.w_down[...])

    def __call__(self, x, cfg: ModelConfig, mix):
        """x [T, E] -> (x [T, E], what `mix(self.mixer, h)` returned besides its output)."""
        eps = cfg.rms_norm_eps
        with jax.named_scope("mixer"):  # (with layers.MIXER_ROW_KERNELS: norm, residual in
            h = layers.pre_norm(x, self.attn_norm[...], eps, unit_offset=True,  # the kernels)
                                fused=hasattr(self, "w_gate_up"))
            out, aux = mix(self.mixer, h)  # [T, E]
            x = layers.add_residual(x, out)
        with jax.named_scope("mlp"):
            if hasattr(self, "w_gate_up"):  # a decode step's rows: two kernels (or None)
                out = layers.mlp_in_kernels(x, self.mlp_norm[...], self.w_gate_up[...],
                                            self.w_down[...], eps, unit_offset=True)
                if out is not None:
                    return out, aux
            h = layers.rms_norm(x, self.mlp_norm[...], eps, unit_offset=True)
            x = x + self.mlp(h)
        return x, aux


class Qwen35(nnx.Module):
    """Token embedding, the decoder blocks of cfg.layer_types, final norm and LM head (tied to
    the embedding when cfg.tie_word_embeddings)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, fused: bool = False):
        check(cfg)
        e, v = cfg.hidden_size, cfg.vocab_size
        self.embed = param((v, e), ("vocab", "embed"), dtype)
        self.layers = nnx.List([Qwen35Block(cfg, t, dtype, fused=fused)
                                for t in cfg.layer_types])
        self.final_norm = param((e,), ("embed",), dtype)
        self.lm_head = None if cfg.tie_word_embeddings else param((e, v), ("embed", "vocab"),
                                                                  dtype)

    def embed_tokens(self, tokens):
        """tokens [...] int32 -> [..., E]; out-of-range ids (bucket padding) are clipped."""
        return layers.embed(tokens, self.embed[...])

    def logits(self, x, cfg: ModelConfig):
        """x [N, E] -> logits [N, V] float32 (final norm, then the LM head)."""
        x = layers.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, unit_offset=True)
        if self.lm_head is None:  # tied: the [V, E] table contracted as stored
            return layers.tied_logits(x, self.embed[...])
        return layers.logits_from_hidden(x, self.lm_head[...])


# ----------------------------------------------------------------------------- pure-dict params


@functools.lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig, fused: bool = False):
    """(graphdef, abstract state) of a model (nnx_pure.abstract)."""
    return nnx_pure.abstract(lambda: Qwen35(cfg, jnp.float32, fused=fused))


def is_fused(params) -> bool:
    """Whether a params dict holds fused layers (qwen3_5.fuse_params; all must agree)."""
    return all_fused(params, "w_gate_up", "qwen3_5")


def shapes(cfg: ModelConfig, *, fused: bool = False) -> dict:
    """The params dict with shape tuples as leaves."""
    return nnx_pure.shapes(_abstract(cfg, fused)[1])


def logical_axes(cfg: ModelConfig, *, fused: bool = False) -> dict:
    """The params dict with each leaf's logical axis names, read from the modules' nnx.Param
    annotations."""
    return nnx_pure.logical_axes(_abstract(cfg, fused)[1])


def bind(params: dict, cfg: ModelConfig) -> Qwen35:
    """A Qwen35 module whose parameters are `params` (traced arrays inside jit: no copies)."""
    return nnx_pure.merge(_abstract(cfg, is_fused(params))[0], params)
