"""Qwen3.5 family config: HF config.json dict -> ModelConfig (ValueError for what it cannot run)."""

from __future__ import annotations

from configs.model_config import ModelConfig
from minipic_jax.models.llama_config import rope_from_hf

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LAYER_TYPES = ("full_attention", "linear_attention")


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
    rope_cfg = rope_from_hf({**text, "partial_rotary_factor": text.get(
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


def check(cfg: ModelConfig):
    """ValueError when the layer types or linear-attention heads do not fit together."""
    if len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(f"Qwen3.5 config: layer_types has {len(cfg.layer_types)} entries for "
                         f"{cfg.num_layers} layers")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hk <= 0 or hv % hk:
        raise ValueError(f"Qwen3.5 config: linear_num_value_heads ({hv}) must be a positive "
                         f"multiple of linear_num_key_heads ({hk})")
