"""Qwen3.5 text model (hybrid: Gated DeltaNet + gated full attention) as pure functions.

Implements serving.model_contract.HybridModelFamily. Layers follow `cfg.layer_types`: "full_attention"
layers use paged KV (kernels_pallas.paged_attention) with the sigmoid output gate, q/k RMSNorm
(1 + w) and partial rotary; "linear_attention" layers are Gated DeltaNet (qwen3_5_gdn.py) with a
recurrent-state cache of `slots` entries, separate from the KV pages, addressed by
RecurrentMetadata.state_slots. HF transformers 5.24.0 `Qwen3_5ForCausalLM` is the oracle.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from kernels_pallas.paged_attention.api import KV_MODES
from minipic_jax.models import layers, rope
from minipic_jax.models.llama import _rope_from_hf, init_from_shapes
from minipic_jax.models.paged_cache import write_and_attend
from minipic_jax.models.qwen3_5_gdn import (GDNParams, gdn_axes, gdn_dims, gdn_mixer, gdn_shapes,
                                            state_shapes)
from minipic_jax.models.qwen3_5_hf import convert_hf, hf_tensor_names  # noqa: F401 (contract)
from minipic_jax.models.qwen3_5_params import (AttnParams, LayerParams,  # noqa: F401 (API)
                                               Qwen35Cache, Qwen35Params)
from serving.model_contract import RecurrentMetadata

IS_HYBRID = True
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LAYER_TYPES = ("full_attention", "linear_attention")
CHUNK = 64  # recurrent checkpoint granularity (the chunked kernel's chunk size)
GDN_IMPLS = (None, "xla", "pallas_fused", "pallas_fused_interpret")


# ----------------------------------------------------------------------------- config


def config_from_hf(hf: dict) -> ModelConfig:
    """HF config.json (Qwen3_5ForCausalLM text config, or the composite Qwen3.5 config with a
    text_config) -> ModelConfig. ValueError for anything this family cannot run."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not a Qwen3.5 type "
                         f"{MODEL_TYPES}")
    text = hf.get("text_config") or hf if model_type == "qwen3_5" else hf
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {text['hidden_act']!r} not supported (silu only)")
    if text.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported by Qwen3.5")
    n_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                       for i in range(n_layers)]
    if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"config.json: layer_types must list {n_layers} entries from "
                         f"{LAYER_TYPES}, got {layer_types}")
    rope_cfg = _rope_from_hf({**text, "partial_rotary_factor": text.get(
        "partial_rotary_factor", (text.get("rope_parameters") or {}).get(
            "partial_rotary_factor", 0.25))})
    heads = int(text["num_attention_heads"])
    eos = text.get("eos_token_id", hf.get("eos_token_id"))
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = text.get("bos_token_id")
    tie = bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return ModelConfig(
        model_type=model_type, vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]), intermediate_size=int(text["intermediate_size"]),
        num_layers=n_layers, num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope=rope_cfg,
        tie_word_embeddings=tie,
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos,
        layer_types=tuple(layer_types),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)))


def _check(cfg: ModelConfig):
    if len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(f"Qwen3.5 config: layer_types has {len(cfg.layer_types)} entries for "
                         f"{cfg.num_layers} layers")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hk <= 0 or hv % hk:
        raise ValueError(f"Qwen3.5 config: linear_num_value_heads ({hv}) must be a positive "
                         f"multiple of linear_num_key_heads ({hk})")


# ----------------------------------------------------------------------------- params


def _attn_shapes(cfg) -> AttnParams:
    e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return AttnParams(wq=(e, h, d), wgate=(e, h, d), wk=(e, k, d), wv=(e, k, d), wo=(h, d, e),
                      q_norm=(d,), k_norm=(d,))


def _shapes(cfg: ModelConfig) -> Qwen35Params:
    _check(cfg)
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    lays = tuple(LayerParams(attn_norm=(e,), mixer=_attn_shapes(cfg) if t == "full_attention"
                             else gdn_shapes(cfg), mlp_norm=(e,), w_gate=(e, f), w_up=(e, f),
                             w_down=(f, e)) for t in cfg.layer_types)
    return Qwen35Params(embed=(v, e), layers=lays, final_norm=(e,),
                        lm_head=None if cfg.tie_word_embeddings else (e, v))


def param_axes(cfg: ModelConfig) -> Qwen35Params:
    """Logical axis names per param (same structure; leaves are tuples of names)."""
    attn = AttnParams(wq=("embed", "heads", "head_dim"), wgate=("embed", "heads", "head_dim"),
                      wk=("embed", "kv_heads", "head_dim"), wv=("embed", "kv_heads", "head_dim"),
                      wo=("heads", "head_dim", "embed"), q_norm=("head_dim",),
                      k_norm=("head_dim",))
    lays = tuple(LayerParams(attn_norm=("embed",), mixer=attn if t == "full_attention"
                             else gdn_axes(), mlp_norm=("embed",), w_gate=("embed", "mlp"),
                             w_up=("embed", "mlp"), w_down=("mlp", "embed"))
                 for t in cfg.layer_types)
    return Qwen35Params(embed=("vocab", "embed"), layers=lays, final_norm=("embed",),
                        lm_head=None if cfg.tie_word_embeddings else ("embed", "vocab"))


def init_params(cfg: ModelConfig, key, dtype=jnp.float32) -> Qwen35Params:
    """Deterministic random weights: normal(0, 0.02), 1-D leaves ones (A_log = 1, dt_bias = 1)."""
    return init_from_shapes(_shapes(cfg), key, dtype)


def fuse_params(params: Qwen35Params, *, consume: bool = False) -> Qwen35Params:
    """Nothing to fuse yet: the params unchanged (the family contract's hook)."""
    del consume
    return params


# ----------------------------------------------------------------------------- cache


def init_cache(cfg: ModelConfig, num_pages: int, block_size: int, max_num_seqs: int = 1,
               dtype=jnp.float32) -> Qwen35Cache:
    """Zeroed cache: KV pages for full-attention layers, max_num_seqs recurrent-state slots per
    GDN layer (conv state in `dtype`, delta state float32)."""
    _check(cfg)
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


# ----------------------------------------------------------------------------- forward


def _attention(x, p: AttnParams, k_pages, v_pages, metadata, cfg, inv, kv_mode, attn_impl,
               write_impl=None, attn_options=None):
    eps = cfg.rms_norm_eps
    q = layers.rms_norm(jnp.einsum("te,ehd->thd", x, p.wq), p.q_norm, eps, unit_offset=True)
    gate = jnp.einsum("te,ehd->thd", x, p.wgate)  # [T, H, D]
    k = layers.rms_norm(jnp.einsum("te,ekd->tkd", x, p.wk), p.k_norm, eps, unit_offset=True)
    v = jnp.einsum("te,ekd->tkd", x, p.wv)  # [T, K, D]
    scaling = rope.attention_scaling(cfg)
    attn, k_pages, v_pages = write_and_attend(
        q, k, v, k_pages, v_pages, metadata, inv, attention_scaling=scaling, kv_mode=kv_mode,
        attn_impl=attn_impl, write_impl=write_impl, attn_options=attn_options)  # [T, H, D]
    attn = attn * jax.nn.sigmoid(gate)
    return jnp.einsum("thd,hde->te", attn, p.wo), k_pages, v_pages


def _recurrent_inputs(metadata, recurrent, n_seqs):
    cu = metadata.cu_q_lens
    lens = cu[1:] - cu[:-1]
    first = jnp.clip(cu[:-1], 0, metadata.num_tokens - 1)
    pos0 = jnp.where(lens > 0, metadata.q_positions[first], 0)  # [S]
    if recurrent is None:  # one slot per sequence, fresh when it starts at position 0
        recurrent = RecurrentMetadata(state_slots=jnp.arange(n_seqs, dtype=jnp.int32),
                                      reset=(lens > 0) & (pos0 == 0))
    return pos0, recurrent


def forward_with_checkpoints(params: Qwen35Params, tokens, metadata, cache: Qwen35Cache,
                             cfg: ModelConfig, *, recurrent=None, logits_indices=None,
                             kv_mode: str = "position_free", attn_impl: str | None = None,
                             checkpoint_at=None, gdn_impl: str | None = None,
                             write_impl: str | None = None, attn_options: dict | None = None,
                             span_pieces=None):
    """`forward`, plus the recurrent states at chunk-aligned positions of each sequence.

    checkpoint_at: None or [S, M] int32 absolute positions (multiples of CHUNK inside
      [pos0, pos0 + new tokens] of the sequence; -1 = none).
    gdn_impl: GDN prefill kernel: None / "xla" (lax.scan), "pallas_fused" (Pallas Triton, GPU),
      "pallas_fused_interpret" (same, interpret mode for CPU tests).
    span_pieces: None or qwen3_5_spans.SpanPieces when the step holds SSEP span rows (their
      attention window is metadata.q_window_start; see qwen3_5_spans.py for the GDN side).
    Returns (logits [N, V] float32, cache, checkpoints) with checkpoints None or a dict
      conv [Lg, S, M, C, Kc-1], delta [Lg, S, M, Hv, Dk, Dv] float32 (Lg = GDN layers); with
      span_pieces.capture also span_maps: a [Lg, Mc, Hv, Dk, Dk], b [Lg, Mc, Hv, Dk, Dv],
      tail [Lg, Mc, C, Kc-1], count [Mc] (the captured pieces' maps, serving/span_maps.py).
    """
    if kv_mode not in KV_MODES:
        raise ValueError(f"forward: kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
    if gdn_impl not in GDN_IMPLS:
        raise ValueError(f"forward: gdn_impl must be one of {GDN_IMPLS}, got {gdn_impl!r}")
    _check(cfg)
    seqs = metadata.num_seqs
    pos0, recurrent = _recurrent_inputs(metadata, recurrent, seqs)
    slots, reset = recurrent.state_slots, recurrent.reset
    inv = rope.inv_freq(cfg)  # [R/2] numpy: a host constant (kernels build cos|sin tables once)
    eps = cfg.rms_norm_eps
    x = layers.embed(tokens, params.embed)  # [T, E]
    new = dict(k=[], v=[], conv=[], delta=[])
    ck_conv, ck_delta, span_maps = [], [], []
    ia = ig = 0
    for i, lp in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            h = layers.rms_norm(x, lp.attn_norm, eps, unit_offset=True)
            if cfg.layer_types[i] == "full_attention":
                out, kp, vp = _attention(h, lp.mixer, cache.k[ia], cache.v[ia], metadata, cfg,
                                         inv, kv_mode, attn_impl, write_impl, attn_options)
                new["k"].append(kp)
                new["v"].append(vp)
                ia += 1
            else:
                conv_c, delta_c = cache.conv[ig], cache.delta[ig]
                keep = ~reset[:, None, None]
                conv0 = jnp.where(keep, conv_c[slots], 0).astype(conv_c.dtype)
                delta0 = jnp.where(keep[..., None], delta_c[slots], 0.0)
                out, conv, delta, ck, maps = gdn_mixer(
                    h, lp.mixer, conv0, delta0, metadata.cu_q_lens, pos0, cfg,
                    checkpoint_at=checkpoint_at, impl=gdn_impl, pieces=span_pieces)
                new["conv"].append(conv_c.at[slots].set(conv))
                new["delta"].append(delta_c.at[slots].set(delta))
                if ck is not None:
                    ck_conv.append(ck[0])
                    ck_delta.append(ck[1])
                if maps is not None:
                    span_maps.append(maps)
                ig += 1
            x = x + out
            h = layers.rms_norm(x, lp.mlp_norm, eps, unit_offset=True)
            x = x + layers.swiglu_mlp(h, lp.w_gate, lp.w_up, lp.w_down)
    with jax.named_scope("lm_head"):
        if logits_indices is not None:
            x = x[logits_indices]
        x = layers.rms_norm(x, params.final_norm, eps, unit_offset=True)
        head = params.embed.T if params.lm_head is None else params.lm_head
        logits = layers.logits_from_hidden(x, head)
    cache = Qwen35Cache(k=tuple(new["k"]), v=tuple(new["v"]), conv=tuple(new["conv"]),
                        delta=tuple(new["delta"]))
    ckpts = None
    if checkpoint_at is not None and ck_conv:
        ckpts = dict(conv=jnp.stack(ck_conv), delta=jnp.stack(ck_delta))
    if span_maps:  # span_pieces.capture: the captured pieces' maps, layer-major
        ckpts = dict(ckpts or {}, span_maps=dict(
            a=jnp.stack([m["a"] for m in span_maps]), b=jnp.stack([m["b"] for m in span_maps]),
            tail=jnp.stack([m["tail"] for m in span_maps]), count=span_maps[0]["count"]))
    return logits, cache, ckpts


def forward(params: Qwen35Params, tokens, metadata, cache: Qwen35Cache, cfg: ModelConfig, *,
            recurrent=None, logits_indices=None, kv_mode: str = "position_free",
            attn_impl: str | None = None, gdn_impl: str | None = None,
            write_impl: str | None = None, attn_options: dict | None = None, span_pieces=None):
    """One ragged step (serving.model_contract.ModelFamily.forward). `recurrent` gives each sequence's state slot and
    whether it starts fresh; None means slot s for sequence s, fresh when it starts at
    position 0. Sequences with no tokens this step keep their state. gdn_impl, span_pieces: see
    forward_with_checkpoints. Returns (logits, cache)."""
    logits, cache, _ = forward_with_checkpoints(
        params, tokens, metadata, cache, cfg, recurrent=recurrent, logits_indices=logits_indices,
        kv_mode=kv_mode, attn_impl=attn_impl, gdn_impl=gdn_impl, write_impl=write_impl,
        attn_options=attn_options, span_pieces=span_pieces)
    return logits, cache
