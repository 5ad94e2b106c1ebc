"""Static, hashable model configuration (passed straight into jitted functions).

Glossary of shape letters used across the project:
  T  tokens in a flat ragged batch     S  sequences in a batch
  P  physical KV pages (blocks)        B  page (block) size in tokens
  L  layers                            E  hidden (embedding) size
  H  query heads                       K  key/value heads
  D  head dim                          R  rotary dim (<= D)
  F  MLP intermediate size             V  vocabulary
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """RoPE parameters, exactly as HF `rope_parameters` / `rope_scaling` describe them."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0  # llama3 / linear
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3
    partial_rotary_factor: float = 1.0  # rotary dim R = int(head_dim * partial_rotary_factor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One decoder-only model. Hybrid (Qwen3.5) fields are ignored by the Llama family."""

    model_type: str = "llama"  # "llama" | "mistral" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid (Qwen3.5 Gated DeltaNet) fields; the Hybrid issue fills these in.
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "linear_attention"
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep paged K/V: the full-attention ones of a hybrid model, else all."""
        if not self.layer_types:
            return self.num_layers
        return self.layer_types.count("full_attention")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)
