"""Named model presets: tiny test models and the shapes of the real models the project targets.

A preset is only a ModelConfig; `minipic_jax.loading.load_model(<preset name>)` instantiates it
with deterministic random weights. Names are matched case-insensitively with '-' and '.' read as
'_' (so "tiny-llama3", "llama3.1-8b" and "llama3_1_8b" all work).
"""

from __future__ import annotations

from configs.model_config import ModelConfig, RopeConfig

LLAMA3_VOCAB = 128256  # 128000 BPE ranks + 256 special tokens
LLAMA3_BOS = 128000  # <|begin_of_text|>
LLAMA3_EOS = (128001, 128008, 128009)  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
BYTE_BOS, BYTE_EOS = 256, 257  # the byte-level tokenizer of the tiny presets

_LLAMA3_1_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=8192)

_LLAMA3_1_8B = ModelConfig(
    model_type="llama", vocab_size=LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope=_LLAMA3_1_ROPE, max_position_embeddings=131072, bos_token_id=LLAMA3_BOS,
    eos_token_ids=LLAMA3_EOS)

PRESETS: dict[str, ModelConfig] = {
    # Byte-level vocabulary (256 bytes + bos/eos + spare ids): the fastest model for unit tests.
    "tiny_llama": ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope=RopeConfig(theta=10000.0),
        max_position_embeddings=4096, bos_token_id=BYTE_BOS, eos_token_ids=(BYTE_EOS,)),
    # The real Llama 3 vocabulary and RoPE with tiny layers: the embedded demo model.
    "tiny_llama3": ModelConfig(
        model_type="llama", vocab_size=LLAMA3_VOCAB, hidden_size=64, intermediate_size=192,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope=_LLAMA3_1_ROPE,
        tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=LLAMA3_BOS,
        eos_token_ids=LLAMA3_EOS),
    # meta-llama/Llama-3.2-1B's shape (16 layers, 8 KV heads of 64, tied embeddings).
    "llama3_2_1b": ModelConfig(
        model_type="llama", vocab_size=LLAMA3_VOCAB, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=LLAMA3_BOS,
        eos_token_ids=LLAMA3_EOS),
    # HuggingFaceTB/SmolLM2-135M-Instruct's shape (30 layers, 9 heads / 3 KV heads of 64, tied
    # embeddings, 49,152-token vocabulary): the CPU speed model (benchmarks/cpu_vs_hf.py).
    "smollm2_135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0), tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
    # meta-llama/Meta-Llama-3-8B.
    "llama3_8b": ModelConfig(
        model_type="llama", vocab_size=LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0), max_position_embeddings=8192, bos_token_id=LLAMA3_BOS,
        eos_token_ids=(128001, 128009)),
    # meta-llama/Llama-3.1-8B.
    "llama3_1_8b": _LLAMA3_1_8B,
    # Tulu3-Block-FT (Block-Attention fine-tune of Llama-3.1-8B): the Llama-3.1-8B shape.
    "tulu3_block_ft": _LLAMA3_1_8B,
    # Byte-level vocabulary, the Qwen3.5 layer pattern (3 Gated DeltaNet + 1 gated attention)
    # with tiny widths: the fast hybrid model for engine tests (a float32 checkpoint is 3 x 5.5 KiB).
    "tiny_qwen3_5": ModelConfig(
        model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000000.0, partial_rotary_factor=0.25),
        tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=BYTE_BOS,
        eos_token_ids=(BYTE_EOS,),
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4),
    # Qwen/Qwen3.5-0.8B text model: 24 layers = 6 x (3 Gated DeltaNet + 1 gated attention),
    # hidden 1024, GDN 16 QK / 16 V heads of 128, attention 8 Q / 2 KV heads of 256 with 25%
    # partial rotary (R = 64), rope_theta 1e7, tied embeddings.
    "qwen3_5_0_8b": ModelConfig(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
        num_layers=24, num_heads=8, num_kv_heads=2, head_dim=256, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000000.0, partial_rotary_factor=0.25),
        tie_word_embeddings=True, max_position_embeddings=262144, bos_token_id=None,
        eos_token_ids=(248044,),
        layer_types=("linear_attention",) * 3 + ("full_attention",)
        + ("linear_attention",) * 3 + ("full_attention",)
        + ("linear_attention",) * 3 + ("full_attention",)
        + ("linear_attention",) * 3 + ("full_attention",)
        + ("linear_attention",) * 3 + ("full_attention",)
        + ("linear_attention",) * 3 + ("full_attention",),
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4),
}


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(".", "_")


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def is_preset(name: str) -> bool:
    return normalize_name(name) in PRESETS


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of a preset; ValueError listing the known names for an unknown one."""
    key = normalize_name(name)
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key]
