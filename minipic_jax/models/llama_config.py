"""Llama family config: HF config.json dict -> ModelConfig (ValueError for what it cannot run)."""

from __future__ import annotations

from configs.model_config import ModelConfig, RopeConfig
from minipic_jax.models import rope

MODEL_TYPES = ("llama", "mistral")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")



def rope_from_hf(hf: dict) -> RopeConfig:
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
    rope_cfg = rope_from_hf(hf)
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


def to_hf_config(cfg: ModelConfig) -> dict:
    """ModelConfig -> an HF config.json dict that config_from_hf (and transformers) read back."""
    r = cfg.rope
    rope_parameters = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type in ("linear", "llama3"):
        rope_parameters["factor"] = r.factor
    if r.rope_type == "llama3":
        rope_parameters.update(low_freq_factor=r.low_freq_factor,
                               high_freq_factor=r.high_freq_factor,
                               original_max_position_embeddings=r.original_max_position_embeddings)
    eos = list(cfg.eos_token_ids)
    return {
        "model_type": cfg.model_type,
        "architectures": ["MistralForCausalLM" if cfg.model_type == "mistral"
                          else "LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        **({"sliding_window": None} if cfg.model_type == "mistral" else {}),
    }
