"""Llama family (Llama 2 / 3 / 3.1, Tulu 3, Mistral without sliding window) as pure functions.

Implements the family contract of `minipic_jax.models.interface`. Params and the KV cache are
registered dataclass pytrees; per-layer weights are a tuple (one entry per layer). Shape letters:
configs/model_config.py. Attention is reached only through `kernels_pallas.paged_attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig, RopeConfig
from kernels_pallas.paged_attention.api import KV_MODES
from kernels_pallas.sharding import paged_attention, write_kv  # per head shard under TP
from kernels_pallas.rope import apply_rope
from minipic_jax.models import layers, rope
from minipic_jax.models.hf_weights import take
from minipic_jax.models.param_init import init_from_shapes

MODEL_TYPES = ("llama", "mistral")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array  # [E]
    wq: jax.Array  # [E, H, D]
    wk: jax.Array  # [E, K, D]
    wv: jax.Array  # [E, K, D]
    wo: jax.Array  # [H, D, E]
    mlp_norm: jax.Array  # [E]
    w_gate: jax.Array  # [E, F]
    w_up: jax.Array  # [E, F]
    w_down: jax.Array  # [F, E]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedLayerParams:
    """LayerParams with the projections that read the same input concatenated (one GEMM each):
    wqkv = [wq | wk | wv] over heads, w_gate_up = [w_gate | w_up] over F. See `fuse_params`.
    The LayerParams names (wq, ..., w_up) stay readable as slices (copies; for references)."""
    attn_norm: jax.Array  # [E]
    wqkv: jax.Array  # [E, H + 2K, D]
    wo: jax.Array  # [H, D, E]
    mlp_norm: jax.Array  # [E]
    w_gate_up: jax.Array  # [E, 2F]
    w_down: jax.Array  # [F, E]
    num_heads: int = dataclasses.field(default=0, metadata=dict(static=True))  # H

    @property
    def wq(self):
        return self.wqkv[:, :self.num_heads]

    @property
    def wk(self):
        return self.wqkv[:, self.num_heads:(self.wqkv.shape[1] + self.num_heads) // 2]

    @property
    def wv(self):
        return self.wqkv[:, (self.wqkv.shape[1] + self.num_heads) // 2:]

    @property
    def w_gate(self):
        return self.w_gate_up[:, :self.w_down.shape[0]]

    @property
    def w_up(self):
        return self.w_gate_up[:, self.w_down.shape[0]:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LlamaParams:
    embed: jax.Array  # [V, E]
    layers: tuple[LayerParams | FusedLayerParams, ...]  # L entries
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None  # [E, V]; None when tied to embed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # L x [P, B, K, D] keys (unrotated in position_free mode)
    v: tuple[jax.Array, ...]  # L x [P, B, K, D]


# ----------------------------------------------------------------------------- config


def _rope_from_hf(hf: dict) -> RopeConfig:
    params = hf.get("rope_parameters")
    if params is None:  # transformers < 5 layout: rope_theta + rope_scaling
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in rope.ROPE_TYPES:
        raise ValueError(f"config.json: RoPE type {rope_type!r} is not supported by the Llama "
                         f"family; supported: {rope.ROPE_TYPES}")
    kw = dict(theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type,
              partial_rotary_factor=float(params.get(
                  "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))))
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise ValueError(f"config.json: RoPE type {rope_type!r} needs 'factor'")
        kw["factor"] = float(params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ValueError(f"config.json: RoPE type 'llama3' needs {key!r}")
        kw.update(low_freq_factor=float(params["low_freq_factor"]),
                  high_freq_factor=float(params["high_freq_factor"]),
                  original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    return RopeConfig(**kw)


def config_from_hf(hf: dict) -> ModelConfig:
    """HF config.json dict -> ModelConfig; ValueError for anything this family cannot run."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not a Llama-family type "
                         f"{MODEL_TYPES}")
    archs = [a for a in hf.get("architectures") or [] if a not in ARCHITECTURES]
    if archs:
        raise ValueError(f"config.json: architectures {archs} are not supported; the Llama family "
                         f"runs {ARCHITECTURES}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"config.json: {flag}=true is not supported by the Llama family")
    max_pos = int(hf.get("max_position_embeddings", 131072 if model_type == "mistral" else 2048))
    mistral = model_type == "mistral"  # absent keys take HF's class defaults
    window = hf.get("sliding_window", 4096 if mistral else None)
    if window is not None and int(window) < max_pos:
        raise ValueError(f"config.json: sliding_window={window} < max_position_embeddings="
                         f"{max_pos}; sliding-window attention is not supported")
    rope_cfg = _rope_from_hf(hf)
    if rope_cfg.partial_rotary_factor != 1.0:  # HF's Llama cannot run it either
        raise ValueError(f"config.json: partial_rotary_factor={rope_cfg.partial_rotary_factor} is "
                         f"not supported by the Llama family")
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id", 2)
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = hf.get("bos_token_id", 1)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads", 8 if mistral else None) or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope_cfg,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
    )


# ----------------------------------------------------------------------------- params


def _shapes(cfg: ModelConfig) -> LlamaParams:
    """The params pytree with shape tuples as leaves (structure shared by init/axes/convert)."""
    e, h, k, d, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    layer = LayerParams(attn_norm=(e,), wq=(e, h, d), wk=(e, k, d), wv=(e, k, d), wo=(h, d, e),
                        mlp_norm=(e,), w_gate=(e, f), w_up=(e, f), w_down=(f, e))
    return LlamaParams(embed=(v, e), layers=(layer,) * cfg.num_layers, final_norm=(e,),
                       lm_head=None if cfg.tie_word_embeddings else (e, v))


def param_axes(cfg: ModelConfig) -> LlamaParams:
    """Logical axis names per param (same structure; leaves are tuples of names)."""
    layer = LayerParams(
        attn_norm=("embed",), wq=("embed", "heads", "head_dim"),
        wk=("embed", "kv_heads", "head_dim"), wv=("embed", "kv_heads", "head_dim"),
        wo=("heads", "head_dim", "embed"), mlp_norm=("embed",), w_gate=("embed", "mlp"),
        w_up=("embed", "mlp"), w_down=("mlp", "embed"))
    return LlamaParams(embed=("vocab", "embed"), layers=(layer,) * cfg.num_layers,
                       final_norm=("embed",),
                       lm_head=None if cfg.tie_word_embeddings else ("embed", "vocab"))


def init_params(cfg: ModelConfig, key, dtype=jnp.float32) -> LlamaParams:
    """Deterministic random weights (normal, std 0.02; norms 1) from `key`."""
    return init_from_shapes(_shapes(cfg), key, dtype)


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every checkpoint tensor convert_hf reads."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight")]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def convert_hf(get_tensor, cfg: ModelConfig, dtype=jnp.float32) -> LlamaParams:
    """HF tensors (torch Linear layout [out, in]) -> LlamaParams in `dtype`.

    get_tensor(name) -> np.ndarray. Shapes are checked (ValueError naming the tensor).
    """
    e, h, k, d, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)

    def get(name, shape, fn=lambda x: x):
        # Transfer as stored (copied: never alias the memory map), then cast and re-layout on device.
        return fn(jnp.array(take(get_tensor, name, shape), copy=True).astype(dtype))

    layer_list = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer_list.append(LayerParams(
            attn_norm=get(p + "input_layernorm.weight", (e,)),
            wq=get(p + "self_attn.q_proj.weight", (h * d, e), lambda w: w.T.reshape(e, h, d)),
            wk=get(p + "self_attn.k_proj.weight", (k * d, e), lambda w: w.T.reshape(e, k, d)),
            wv=get(p + "self_attn.v_proj.weight", (k * d, e), lambda w: w.T.reshape(e, k, d)),
            wo=get(p + "self_attn.o_proj.weight", (e, h * d), lambda w: w.T.reshape(h, d, e)),
            mlp_norm=get(p + "post_attention_layernorm.weight", (e,)),
            w_gate=get(p + "mlp.gate_proj.weight", (f, e), lambda w: w.T),
            w_up=get(p + "mlp.up_proj.weight", (f, e), lambda w: w.T),
            w_down=get(p + "mlp.down_proj.weight", (e, f), lambda w: w.T),
        ))
    return LlamaParams(
        embed=get("model.embed_tokens.weight", (v, e)),
        layers=tuple(layer_list),
        final_norm=get("model.norm.weight", (e,)),
        lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight", (v, e), lambda w: w.T),
    )


@jax.jit
def _fuse_layer(lp: LayerParams) -> FusedLayerParams:
    return FusedLayerParams(
        attn_norm=lp.attn_norm, wqkv=jnp.concatenate([lp.wq, lp.wk, lp.wv], axis=1),
        wo=lp.wo, mlp_norm=lp.mlp_norm,
        w_gate_up=jnp.concatenate([lp.w_gate, lp.w_up], axis=1), w_down=lp.w_down,
        num_heads=lp.wq.shape[1])


def fuse_params(params: LlamaParams, *, consume: bool = False) -> LlamaParams:
    """Params with fused QKV and gate/up projections (fewer, larger GEMMs per layer; the same
    products, so outputs agree up to the GEMM's accumulation order). Done one layer at a time;
    with consume=True each original layer's arrays are deleted once fused, so peak memory grows
    by one layer only (the caller must hold no other reference to `params`)."""
    names = ("wq", "wk", "wv", "w_gate", "w_up")
    uses: dict[int, int] = {}  # array id -> layers still to fuse that read it (shared arrays)
    for lp in params.layers:
        if isinstance(lp, LayerParams):
            for n in names:
                uses[id(getattr(lp, n))] = uses.get(id(getattr(lp, n)), 0) + 1
    fused = []
    for lp in params.layers:
        if isinstance(lp, FusedLayerParams):
            fused.append(lp)
            continue
        f = _fuse_layer(lp)
        if consume:
            jax.block_until_ready(f)
            for n in names:
                w = getattr(lp, n)
                uses[id(w)] -= 1
                if uses[id(w)] == 0 and w is not params.embed and w is not params.lm_head:
                    w.delete()
        fused.append(f)
    return dataclasses.replace(params, layers=tuple(fused))


# ----------------------------------------------------------------------------- cache + forward


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, max_num_seqs: int = 0,
               dtype=jnp.float32) -> KVCache:
    """Zeroed paged KV cache: per layer k/v [P, B, K, D]. (max_num_seqs is unused here.)"""
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def cache_axes(cfg: ModelConfig) -> KVCache:
    """Logical axis names per cache array (init_cache's structure)."""
    kv = ("pages", "page", "kv_heads", "head_dim")
    return KVCache(k=(kv,) * cfg.num_layers, v=(kv,) * cfg.num_layers)


def _swiglu_fused(x, w_gate_up, w_down):
    """layers.swiglu_mlp with w_gate_up = [w_gate | w_up] ([E, 2F]): one GEMM for both."""
    f = w_down.shape[0]
    gate_up = jnp.einsum("te,ef->tf", x, w_gate_up)  # [T, 2F]
    return jnp.einsum("tf,fe->te", jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:], w_down)  # [T, E]


def _attention_block(x, lp: LayerParams, k_pages, v_pages, metadata, cfg, inv, kv_mode, attn_impl,
                     write_impl=None, attn_options=None):
    scaling = rope.attention_scaling(cfg)
    h = layers.rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)  # [T, E]
    if isinstance(lp, FusedLayerParams):
        qkv = jnp.einsum("te,end->tnd", h, lp.wqkv)  # [T, H + 2K, D]
        nh, nk = cfg.num_heads, cfg.num_kv_heads
        if lp.wqkv.shape[1] != nh + 2 * nk:
            raise ValueError(f"llama.forward: wqkv has {lp.wqkv.shape[1]} heads, config wants "
                             f"{nh} + 2 x {nk}")
        q, k, v = qkv[:, :nh], qkv[:, nh:nh + nk], qkv[:, nh + nk:]
    else:
        q = jnp.einsum("te,ehd->thd", h, lp.wq)  # [T, H, D]
        k = jnp.einsum("te,ekd->tkd", h, lp.wk)  # [T, K, D]
        v = jnp.einsum("te,ekd->tkd", h, lp.wv)  # [T, K, D]
    if kv_mode == "rotated":
        k = apply_rope(k, metadata.q_positions, inv, scaling)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, metadata.slot_mapping,
                                implementation=write_impl)
    attn = paged_attention(q, k_pages, v_pages, metadata, inv, kv_mode=kv_mode,
                           attention_scaling=scaling, implementation=attn_impl,
                           kernel_options=attn_options)  # [T, H, D]
    return x + jnp.einsum("thd,hde->te", attn, lp.wo), k_pages, v_pages


def forward(params: LlamaParams, tokens, metadata, cache: KVCache, cfg: ModelConfig, *,
            recurrent=None, logits_indices=None, kv_mode: str = "position_free",
            attn_impl: str | None = None, write_impl: str | None = None,
            attn_options: dict | None = None):
    """One ragged step: writes this step's K/V into the cache and returns logits.

    Args:
      params: LlamaParams.
      tokens: [T] int32 (flat over the batch, bucket padding allowed).
      metadata: kernels_pallas AttentionMetadata for these T tokens.
      cache: KVCache (donate it when jitting).
      cfg: static ModelConfig.
      recurrent: unused (pure-attention model).
      logits_indices: [N] int32 rows of T to compute logits for; None = all rows.
      kv_mode: "position_free" (keys stored unrotated) or "rotated".
      attn_impl: paged_attention implementation (None = best available).
      write_impl: write_kv implementation (None = best available).
      attn_options: paged_attention kernel_options (e.g. {"rope": "table", "max_position": n}).
    Returns:
      (logits [N, V] float32, updated KVCache).
    """
    del recurrent
    if kv_mode not in KV_MODES:
        raise ValueError(f"forward: kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
    inv = rope.inv_freq(cfg)  # [R/2] numpy: a host constant (kernels build cos|sin tables once)
    x = layers.embed(tokens, params.embed)  # [T, E]
    new_k, new_v = [], []
    for i, lp in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                x, kp, vp = _attention_block(x, lp, cache.k[i], cache.v[i], metadata, cfg, inv,
                                             kv_mode, attn_impl, write_impl, attn_options)
            with jax.named_scope("mlp"):
                h = layers.rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
                if isinstance(lp, FusedLayerParams):
                    x = x + _swiglu_fused(h, lp.w_gate_up, lp.w_down)
                else:
                    x = x + layers.swiglu_mlp(h, lp.w_gate, lp.w_up, lp.w_down)
        new_k.append(kp)
        new_v.append(vp)
    with jax.named_scope("lm_head"):
        if logits_indices is not None:
            x = x[logits_indices]  # [N, E]
        x = layers.rms_norm(x, params.final_norm, cfg.rms_norm_eps)
        head = params.embed.T if params.lm_head is None else params.lm_head  # [E, V]
        logits = layers.logits_from_hidden(x, head)  # [N, V] float32
    return logits, KVCache(k=tuple(new_k), v=tuple(new_v))
