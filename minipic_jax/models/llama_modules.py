"""The Llama model as Flax NNX modules, used pure-functionally.

The modules own the math and the parameter metadata (shapes and logical sharding axes); params are
a plain nested dict that jitted steps take as an argument and `bind` merges into the cached graph
definition inside the trace (nnx_pure.py says how).

Attention is a callable handed in by the caller, so the same blocks serve the engine's paged step
(`attend` writes K/V into the paged cache and calls the paged kernel) and the training forward
(`attend` is dense attention with the Block-Attention mask). Shape letters: configs/model_config.py.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from configs.model_config import ModelConfig
from minipic_jax.models import layers, nnx_pure
from minipic_jax.models.nnx_pure import param as _param
from minipic_jax.models.param_fusion import all_fused

# attend(q [T, H, D], k [T, K, D], v [T, K, D], kv_state) -> (attn [T, H, D], kv_state)
Attend = Callable


class LlamaBlock(nnx.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU MLP, residual adds."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
        e, h, k, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size)
        self.attn_norm = _param((e,), ("embed",), dtype)
        self.wq = _param((e, h, d), ("embed", "heads", "head_dim"), dtype)
        self.wk = _param((e, k, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.wv = _param((e, k, d), ("embed", "kv_heads", "head_dim"), dtype)
        self.wo = _param((h, d, e), ("heads", "head_dim", "embed"), dtype)
        self.mlp_norm = _param((e,), ("embed",), dtype)
        self.w_gate = _param((e, f), ("embed", "mlp"), dtype)
        self.w_up = _param((e, f), ("embed", "mlp"), dtype)
        self.w_down = _param((f, e), ("mlp", "embed"), dtype)

    def qkv(self, h):
        """h [T, E] (or a layers.Normed) -> q [T, H, D], k [T, K, D], v [T, K, D]."""
        h = layers.normed(h)
        return (jnp.einsum("te,ehd->thd", h, self.wq[...]),
                jnp.einsum("te,ekd->tkd", h, self.wk[...]),
                jnp.einsum("te,ekd->tkd", h, self.wv[...]))

    def gate_up(self, h):
        """h [T, E] -> gate [T, F], up [T, F]."""
        return (jnp.einsum("te,ef->tf", h, self.w_gate[...]),
                jnp.einsum("te,ef->tf", h, self.w_up[...]))

    def __call__(self, x, cfg: ModelConfig, attend: Attend, kv_state):
        """x [T, E] -> (x [T, E], kv_state as `attend` returns it)."""
        with jax.named_scope("attention"):  # (layers.MIXER_ROW_KERNELS: norm, residual in
            h = layers.pre_norm(x, self.attn_norm[...], cfg.rms_norm_eps,  # the kernels)
                                fused=hasattr(self, "wqkv"))
            q, k, v = self.qkv(h)
            attn, kv_state = attend(q, k, v, kv_state)  # [T, H, D]
            x = layers.add_residual(x, layers.heads_projection(attn, self.wo[...], h))
        with jax.named_scope("mlp"):
            if hasattr(self, "w_gate_up"):  # a decode step's rows: two kernels (or None)
                out = layers.mlp_in_kernels(x, self.mlp_norm[...], self.w_gate_up[...],
                                            self.w_down[...], cfg.rms_norm_eps,
                                            unit_offset=False)
                if out is not None:
                    return out, kv_state
            h = layers.rms_norm(x, self.mlp_norm[...], cfg.rms_norm_eps)
            gate, up = self.gate_up(h)
            x = x + jnp.einsum("tf,fe->te", jax.nn.silu(gate) * up, self.w_down[...])  # [T, E]
        return x, kv_state


class FusedLlamaBlock(LlamaBlock):
    """LlamaBlock with the projections that read the same input concatenated (one GEMM each):
    wqkv = [wq | wk | wv] over heads, w_gate_up = [w_gate | w_up] over F. Same products, so
    outputs agree up to the GEMM's accumulation order."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
        e, h, k, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size)
        self.num_heads, self.num_kv_heads = h, k
        self.attn_norm = _param((e,), ("embed",), dtype)
        self.wqkv = _param((e, h + 2 * k, d), ("embed", "qkv_heads", "head_dim"), dtype)
        self.wo = _param((h, d, e), ("heads", "head_dim", "embed"), dtype)
        self.mlp_norm = _param((e,), ("embed",), dtype)
        self.w_gate_up = _param((e, 2 * f), ("embed", "mlp"), dtype)
        self.w_down = _param((f, e), ("mlp", "embed"), dtype)

    def qkv(self, h):
        nh, nk = self.num_heads, self.num_kv_heads
        qkv = layers.project_heads(h, self.wqkv[...])  # [T, H + 2K, D] (a Normed's norm in it)
        return qkv[:, :nh], qkv[:, nh:nh + nk], qkv[:, nh + nk:]

    def gate_up(self, h):
        f = self.w_down.shape[0]
        gate_up = jnp.einsum("te,ef->tf", h, self.w_gate_up[...])  # [T, 2F]
        return gate_up[:, :f], gate_up[:, f:]


class Llama(nnx.Module):
    """Token embedding, L decoder blocks, final norm and LM head (tied to the embedding when
    cfg.tie_word_embeddings)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, fused: bool = False):
        e, v = cfg.hidden_size, cfg.vocab_size
        block = FusedLlamaBlock if fused else LlamaBlock
        self.embed = _param((v, e), ("vocab", "embed"), dtype)
        self.layers = nnx.List([block(cfg, dtype) for _ in range(cfg.num_layers)])
        self.final_norm = _param((e,), ("embed",), dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param((e, v), ("embed", "vocab"),
                                                                   dtype)

    def embed_tokens(self, tokens):
        """tokens [...] int32 -> [..., E]; out-of-range ids (bucket padding) are clipped."""
        return layers.embed(tokens, self.embed[...])

    def logits(self, x, cfg: ModelConfig):
        """x [N, E] -> logits [N, V] float32 (final norm, then the LM head)."""
        x = layers.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        if self.lm_head is None:  # tied: the [V, E] table contracted as stored
            return layers.tied_logits(x, self.embed[...])
        return layers.logits_from_hidden(x, self.lm_head[...])


# ----------------------------------------------------------------------------- pure-dict params


@functools.lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig, fused: bool):
    """(graphdef, abstract state) of a model (nnx_pure.abstract)."""
    return nnx_pure.abstract(lambda: Llama(cfg, jnp.float32, fused=fused))


def is_fused(params) -> bool:
    """Whether a params dict holds fused layers (all of them must agree)."""
    return all_fused(params, "wqkv", "llama")


def shapes(cfg: ModelConfig, *, fused: bool = False) -> dict:
    """The params dict with shape tuples as leaves."""
    return nnx_pure.shapes(_abstract(cfg, fused)[1])


def logical_axes(cfg: ModelConfig, *, fused: bool = False) -> dict:
    """The params dict with each leaf's logical axis names (a tuple of str), read from the
    modules' nnx.Param annotations."""
    return nnx_pure.logical_axes(_abstract(cfg, fused)[1])


def bind(params: dict, cfg: ModelConfig) -> Llama:
    """A Llama module whose parameters are `params` (traced arrays inside jit: no copies)."""
    return nnx_pure.merge(_abstract(cfg, is_fused(params))[0], params)
